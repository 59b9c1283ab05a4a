"""Stand-ins for the sidecar's peers, each a real server on 127.0.0.1 with a free port, written
from that peer's facts (its source, its docs), never from the code under test.

- :mod:`tests.fakes.engine`: the scriptable fault-injection engine (``FakeEngine``).
- :mod:`tests.fakes.kinds`: one fake per engine kind (vLLM, SGLang, a close-only OpenAI server).
- :mod:`tests.fakes.responses`: vLLM's Responses API background mode.
- :mod:`tests.fakes.ws`: upstreams that speak upgraded protocols (WebSocket, vLLM's realtime).
- :mod:`tests.fakes.upstreams`: misbehaving raw asyncio upstreams the fake engine cannot play.
- :mod:`tests.fakes.routing_sidecar`: llm-d's routing sidecar (the decode pod's P/D proxy).
"""
