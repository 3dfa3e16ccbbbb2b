"""Model specs and the models meshplan builds: the zoo's GPT/Llama (`transformer`), Hugging Face
configs (`hf`), user files (`filemodel`); `registry` turns a spec string into a model."""
