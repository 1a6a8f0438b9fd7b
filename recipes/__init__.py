"""ResNet-style image-classification recipes built on :mod:`lightning_strategies` (run from a checkout)."""
