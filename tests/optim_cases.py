"""Cases shared by the Lamb and Lars tests (the ``foreach`` fixture is in tests/unit/conftest.py)."""

SHAPES = [(1,), (7,), (5, 3), (4, 3, 3, 3)]  # scalar-ish, 1-D, 2-D (linear), 4-D (conv)
