"""``make demo``'s count of the tokens a client received (``demo.__main__.content_events``), on
vLLM-shaped chat chunks: the role-only first chunk is not a token (it made the demo print -1
wasted tokens through the sidecar, issue 27)."""

from __future__ import annotations

import json

from demo.__main__ import content_events


def _chunk(delta: dict[str, str]) -> bytes:
    # vllm/entrypoints/openai/serving_chat.py: the first chunk names the role, the next carry text
    return b"data: " + json.dumps({
        "id": "chatcmpl-demo", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
    }, separators=(",", ":")).encode()


def test_the_role_chunk_and_done_are_not_tokens() -> None:
    events = [_chunk({"role": "assistant", "content": ""})]
    events += [_chunk({"content": f" w{i}"}) for i in range(5)]
    events.append(b"data: [DONE]")
    assert content_events(events) == 5
    # The substring count the demo used before counted the role chunk as a token too.
    assert sum(1 for e in events if b'"content"' in e) == 6


def test_a_chunk_without_text_is_not_a_token() -> None:
    events = [_chunk({"content": ""}), _chunk({}), _chunk({"content": "x"})]
    assert content_events(events) == 1
