"""Serving built artifacts behind NVIDIA Triton Inference Server.

* :mod:`.protocol` — the request/response contract of the served model (tensor names,
  dtypes, shapes), request parsing and chunk → response mapping; pure Python + numpy,
  shared by the model, the clients and the docs test.
* :mod:`.repository` — ``lade-export triton``: writes ``REPO/<name>/config.pbtxt``,
  ``REPO/<name>/1/model.py`` and ``REPO/<name>/lade_export.json``.
* ``triton_model.py`` — the Python-backend model copied to ``REPO/<name>/1/model.py``: a
  thin adapter between ``triton_python_backend_utils`` and :mod:`.protocol`.
* :mod:`.local` — runs the ``tritonserver`` binary bundled in the ``nvidia-pytriton``
  wheel on this machine (tests, benchmarks, development); production uses the NGC
  container (docs/serving.md).
* :mod:`.client` — a small asyncio streaming client on ``tritonclient.grpc.aio``.
* :mod:`.openai_api` — ``lade-export serve``: an OpenAI-compatible HTTP server on the
  continuous-batching scheduler (the ``http`` extra: Starlette, uvicorn, prometheus-client),
  with :mod:`.openai_schema` (request fields, checks, the error schema),
  :mod:`.openai_stream` (a request's reader thread and its answer, whole or as server-sent
  events) and :mod:`.openai_metrics` (``GET /metrics``).

Nothing here imports PyTorch; :mod:`.client` needs ``tritonclient[grpc]`` (the ``serve``
extra) and :mod:`.local` the ``nvidia-pytriton`` wheel.
"""
