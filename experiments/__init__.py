"""Hydra apps: thin ``@hydra.main`` entry points over plain library functions."""
