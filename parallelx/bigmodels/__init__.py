"""Models bigger than one rank: built without their weights, weights in and out of the shards, memory.

``meta.py``: :func:`init_module` (a build on the meta device that records how each tensor is made)
and the replay that gives each tensor its eager value, one tensor at a time; ``estimate.py``: what
each rank holds under each backend.
"""
