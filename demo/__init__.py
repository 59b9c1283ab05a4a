"""``python -m demo``: watch a real vLLM engine keep generating for a client that left, then
watch the sidecar stop it. See ``demo/__main__.py``."""
