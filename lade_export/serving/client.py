"""A small asyncio streaming client for models written by ``lade-export triton``.

Each request is its own gRPC bidirectional stream (``tritonclient.grpc.aio``), so one
request can be cancelled (cancelling a gRPC stream cancels every request on it) and its
timing measured alone. Needs ``tritonclient[grpc]`` (the ``serve`` extra)::

    import asyncio
    from tritonclient.grpc.aio import InferenceServerClient
    from lade_export.serving.client import stream_generate

    async def main():
        client = InferenceServerClient("127.0.0.1:8001")
        out = await stream_generate(client, "smollm2-135m-instruct", prompt="Hi!", max_new_tokens=64)
        if out.error is not None:  # an error response: its message, and no stats
            print("error:", out.error)
        else:
            print(out.text, out.stop_reason, out.stats["compression_ratio"])
        await client.close()

    asyncio.run(main())
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from .protocol import INPUTS

_SPECS = {s.name: s for s in INPUTS}


def request_inputs(prompt: str | None = None, *, prompt_token_ids=None, chat: bool | None = None,
                   max_new_tokens: int | None = None, profile: str | None = None, stop=None,
                   temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                   seed: int | None = None, parse_special_in_messages: bool | None = None) -> list:
    """``tritonclient.grpc.InferInput`` tensors of one request (absent values are left out).

    Args:
        prompt: text; or ``prompt_token_ids`` (int ids, used as given).
        chat, max_new_tokens, profile, stop, temperature, top_k, top_p, seed,
            parse_special_in_messages: see :data:`lade_export.serving.protocol.INPUTS`.
    """
    from tritonclient.grpc import InferInput

    values = {
        "prompt": None if prompt is None else np.array([prompt.encode("utf-8")], dtype=np.object_),
        "prompt_token_ids": None if prompt_token_ids is None else np.asarray(prompt_token_ids, dtype=np.int64),
        "chat": None if chat is None else np.array([chat], dtype=np.bool_),
        "max_new_tokens": None if max_new_tokens is None else np.array([max_new_tokens], dtype=np.int32),
        "profile": None if profile is None else np.array([profile.encode("utf-8")], dtype=np.object_),
        "stop": None if stop is None else np.array([s.encode("utf-8") for s in ([stop] if isinstance(stop, str) else stop)],
                                                   dtype=np.object_),
        "temperature": None if temperature is None else np.array([temperature], dtype=np.float32),
        "top_k": None if top_k is None else np.array([top_k], dtype=np.int32),
        "top_p": None if top_p is None else np.array([top_p], dtype=np.float32),
        "seed": None if seed is None else np.array([seed], dtype=np.uint64),
        "parse_special_in_messages": None if parse_special_in_messages is None else
        np.array([parse_special_in_messages], dtype=np.bool_),
    }
    inputs = []
    for name, value in values.items():
        if value is None:
            continue
        tensor = InferInput(name, list(value.shape), _SPECS[name].client_dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


@dataclasses.dataclass
class StreamedGeneration:
    """What the client saw of one streamed request.

    Attributes:
        text: the concatenated text chunks.
        token_ids: the concatenated token ids.
        stop_reason: from the last response (None if the stream ended without one).
        stats: the last response's statistics (dict), or None.
        error: the error message of an error response (or of the call), or None.
        sent_s: ``time.perf_counter()`` when the request was sent.
        response_s: arrival time of each response (perf_counter seconds).
        response_tokens: tokens in each response.
        cancelled: the client cancelled the request.
    """

    text: str = ""
    token_ids: list = dataclasses.field(default_factory=list)
    stop_reason: str | None = None
    stats: dict | None = None
    error: str | None = None
    sent_s: float = 0.0
    response_s: list = dataclasses.field(default_factory=list)
    response_tokens: list = dataclasses.field(default_factory=list)
    cancelled: bool = False

    @property
    def first_token_s(self) -> float | None:
        """Time to first token: seconds from sending to the first response with a token."""
        for t, n in zip(self.response_s, self.response_tokens):
            if n:
                return t - self.sent_s
        return None

    @property
    def per_token_s(self) -> float | None:
        """Mean seconds per token after the first response with tokens (time per output token)."""
        firsts = [i for i, n in enumerate(self.response_tokens) if n]
        if not firsts:
            return None
        first = firsts[0]
        later = sum(self.response_tokens[first + 1:])
        return (self.response_s[-1] - self.response_s[first]) / later if later else None


async def stream_generate(client, model_name: str, *, request_id: str = "", cancel_after: int | None = None,
                          **request) -> StreamedGeneration:
    """Send one request on its own stream and collect its responses.

    Args:
        client: a ``tritonclient.grpc.aio.InferenceServerClient``.
        model_name: the served model.
        request_id: Triton's request id (shows in the server's log lines).
        cancel_after: cancel the request after this many responses (None: never).
        **request: :func:`request_inputs` arguments.

    Returns:
        :class:`StreamedGeneration` (an error response is returned in ``error``, not raised).
    """
    inputs = request_inputs(**request)
    out = StreamedGeneration()

    async def requests():
        yield {"model_name": model_name, "inputs": inputs, "request_id": request_id}

    out.sent_s = time.perf_counter()
    responses = client.stream_infer(requests())
    pieces = []
    done = False
    # Read to the end of the stream: the request iterator is exhausted after one request
    # (the client half-closes) and the server closes the stream after the final response.
    # Cancelling the call after a final response instead made Triton 2.51 keep the model
    # live at shutdown (until its exit timeout).
    async for result, error in responses:
        now = time.perf_counter()
        if done:
            continue
        if error is not None:
            out.error = error.message() if hasattr(error, "message") else str(error)
            done = True
            continue
        text = result.as_numpy("text")
        ids = result.as_numpy("token_ids")
        reason = result.as_numpy("stop_reason")
        stats = result.as_numpy("stats")
        pieces.append(text[0].decode("utf-8") if text is not None and text.size else "")
        new = [] if ids is None else [int(t) for t in ids.reshape(-1)]
        out.token_ids += new
        out.response_s.append(now)
        out.response_tokens.append(len(new))
        if reason is not None and reason.size and reason[0]:
            out.stop_reason = reason[0].decode()
            out.stats = json.loads(stats[0]) if stats is not None and stats.size and stats[0] else None
            done = True
        elif cancel_after is not None and len(out.response_s) >= cancel_after:
            responses.cancel()  # cancels the request on the server; the iteration ends here
            out.cancelled = True
            break
    out.text = "".join(pieces)
    return out
