"""Measure the machine meshplan runs on (`runner`, `microbench`) and fit profile fields (`fits`)."""
