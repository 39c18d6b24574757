"""The sandbox's process tree below the server: supervisor, templates, slot processes and the children they fork per
sample, and the reward's loading and calls in them."""
