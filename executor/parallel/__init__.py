"""One module per parallelism technique the executor applies to a model."""
