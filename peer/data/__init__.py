"""Training data: text files into train and held-out validation bytes, and the samplers over them.

May import dht and peer.config.
"""
