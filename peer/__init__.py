"""Swarmtrain peer runtime."""
