"""Triton Python-backend model serving a lade-export artifact with streamed lookahead decoding.

Written into ``REPO/<name>/<version>/model.py`` by ``lade-export triton`` (the template
is ``lade_export/serving/triton_model.py``); Triton runs it in one stub process per
model instance. It is only an adapter: request tensors are parsed and responses built by
:mod:`lade_export.serving.protocol`, the decoding is :func:`lade_export.load` /
``Model.stream`` — this file is where the runtime's API meets Triton's.

* ``initialize`` loads the artifact named by the ``artifact_dir`` parameter once per
  instance (a relative path is read from the version directory) and, with the
  ``batching`` parameter (the default on ONNX Runtime), gives it one
  :class:`lade_export.scheduler.Scheduler` (options ``token_budget``, ``kv_tokens``,
  ``width_policy``, and ``max_concurrent_requests`` as its ``max_batch``): every request of the instance then
  runs in the scheduler's shared forward passes, each output equal to its solo run.
* ``execute`` parses each request and opens its stream (a bad request is answered with
  its error response right there), hands the reading of the stream to a worker thread
  and returns (decoupled model: Triton sends the instance its next requests while these
  decode); up to ``max_concurrent_requests`` requests decode at once per instance. A bad
  request so never waits for a free worker to get its error. With the scheduler the
  workers are its readers: whichever waits for a chunk while no pass runs runs the next
  pass for every request (leader/follower, no thread of its own).
* each decode step becomes one response; the last one carries ``stop_reason``,
  ``stats`` (with the scheduler's pass counters of the instance) and the final flag.
* a client cancellation (``is_cancelled``) stops the request before its next step and
  frees its KV cache; a bad request gets an INVALID_ARG error response and the instance
  keeps serving.

Needs ``lade_export`` (and its runtime dependencies) importable by the Python that runs
the stub; see docs/serving.md.
"""

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    """One model instance: an artifact, its engine, its scheduler (with ``batching``) and a
    pool of request threads."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("this model streams: its config needs model_transaction_policy "
                                                "{ decoupled: true }")
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        if params.get("device") == "cuda" and args["model_instance_kind"] == "GPU":
            # Triton starts one stub process per instance: pin it to the instance's GPU
            # before the engine initializes CUDA.
            os.environ["CUDA_VISIBLE_DEVICES"] = args["model_instance_device_id"]

        import lade_export
        from lade_export.errors import LadeError
        from lade_export.serving import protocol

        self.protocol = protocol
        self.LadeError = LadeError
        self.instance = args["model_instance_name"]
        try:
            self.settings = protocol.ServingSettings.from_parameters(params)
            artifact = Path(self.settings.artifact_dir)
            if not artifact.is_absolute():
                artifact = Path(args["model_repository"]) / args["model_version"] / artifact
            batching = self.settings.batching
            scheduler = dict(token_budget=self.settings.token_budget, max_batch=self.settings.max_concurrent_requests,
                             kv_tokens=self.settings.kv_tokens or None,
                             width_policy=self.settings.width_policy) if batching else {}
            self.model = lade_export.load(artifact, backend=self.settings.backend, threads=self.settings.threads or None,
                                          device=self.settings.device, verify=self.settings.verify, batching=batching,
                                          **scheduler)
            self.scheduler = self.model.scheduler  # None without batching
        except LadeError as err:
            raise pb_utils.TritonModelException(str(err)) from None
        self.closing = threading.Event()
        threading.Thread(target=self._watch_stop, name=f"lade-{self.instance}-watch", daemon=True).start()
        self.pool = ThreadPoolExecutor(max_workers=self.settings.max_concurrent_requests,
                                       thread_name_prefix=f"lade-{self.instance}")
        if self.scheduler is not None:
            batching = (f"scheduler: max_batch {self.scheduler.max_batch}, token_budget {self.scheduler.token_budget}, "
                        f"kv_tokens {self.scheduler.kv_tokens}, width_policy {self.scheduler.width_policy.name}")
        else:
            batching = f"no scheduler: up to {self.settings.max_concurrent_requests} requests on their own passes"
        pb_utils.Logger.log_info(f"{self.instance}: loaded {artifact} on {self.settings.backend}/{self.settings.device} "
                                 f"in {self.model.load_s:.2f}s; profiles {', '.join(self.settings.profile_names)}; "
                                 f"{batching}")

    def execute(self, requests):
        for request in requests:
            try:
                started = self._start(request)  # bad requests are answered here, before execute returns
            except Exception as err:  # the error response itself failed (client gone): nothing to answer
                pb_utils.Logger.log_error(f"{self.instance}: cannot answer a request: {type(err).__name__}: {err}")
                continue
            if started is not None:
                self.pool.submit(self._serve, *started)
        return None

    # -- one request -----------------------------------------------------------------------

    def _input(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    def _fail(self, sender, message, code):
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), flags=FINAL)

    def _start(self, request):
        """Parse a request and open its stream; answer it with an error response instead
        when it is bad. Returns (sender, request id, parsed request, stream) or None."""
        sender = request.get_response_sender()
        rid = request.request_id() or "-"
        try:
            if self.closing.is_set():
                self._fail(sender, "the model is unloading", pb_utils.TritonError.UNAVAILABLE)
                return None
            req = self.protocol.parse_request(lambda name: self._input(request, name), self.settings)
            # cancel=closing: an unloading instance ends its requests at their next pass, read or not
            return sender, rid, req, self.model.stream(req.prompt, cancel=self.closing,
                                                       **req.stream_kwargs(self.settings))
        except self.LadeError as err:
            pb_utils.Logger.log_info(f"{self.instance}: request {rid} rejected: {err}")
            self._fail(sender, str(err), pb_utils.TritonError.INVALID_ARG)
        except Exception as err:  # never let one request take the instance down
            pb_utils.Logger.log_error(f"{self.instance}: request {rid} failed: {type(err).__name__}: {err}")
            self._fail(sender, f"internal error: {type(err).__name__}: {err}", pb_utils.TritonError.INTERNAL)
        return None

    def _serve(self, sender, rid, req, stream):
        try:
            self._decode(sender, rid, req, stream)
        except Exception as err:  # an engine failure ends this request only
            pb_utils.Logger.log_error(f"{self.instance}: request {rid} failed: {type(err).__name__}: {err}")
            try:
                self._fail(sender, f"internal error: {type(err).__name__}: {err}", pb_utils.TritonError.INTERNAL)
            except Exception:
                pass

    def _scheduler_stats(self) -> dict:
        """The instance's scheduler counters since it loaded: ``passes`` (forward passes),
        ``shared_passes`` (passes that carried more than one request), ``most_requests_per_pass``,
        and its options ``max_batch``, ``token_budget``, ``kv_tokens``, ``width_policy``."""
        s = self.scheduler
        shapes = dict(s.pass_shapes)  # (requests, rows) -> passes; a copy, the lead thread adds to it
        return {"passes": s.passes, "shared_passes": sum(n for (k, _), n in shapes.items() if k > 1),
                "most_requests_per_pass": max((k for k, _ in shapes), default=0), "max_batch": s.max_batch,
                "token_budget": s.token_budget, "kv_tokens": s.kv_tokens, "width_policy": s.width_policy.name}

    def _decode(self, sender, rid, req, stream):
        new_tokens = 0
        with stream:  # leaving the block frees the request's KV cache
            for chunk in stream:
                if sender.is_cancelled() or self.closing.is_set():
                    why = "cancelled by the client" if sender.is_cancelled() else "stopped: the model is unloading"
                    pb_utils.Logger.log_info(f"{self.instance}: request {rid} {why} after {new_tokens} new tokens "
                                             f"(max_new_tokens {req.max_new_tokens})")
                    self._fail(sender, f"request {why}", pb_utils.TritonError.CANCELLED)
                    return
                new_tokens += len(chunk.token_ids)
                extra = None
                if chunk.final:
                    extra = {"profile": req.profile, "instance": self.instance}
                    if self.scheduler is not None:
                        extra["scheduler"] = self._scheduler_stats()
                outputs = self.protocol.chunk_outputs(chunk, extra)
                response = pb_utils.InferenceResponse([pb_utils.Tensor(name, value) for name, value in outputs.items()])
                sender.send(response, flags=FINAL if chunk.final else 0)
                if chunk.final:
                    return

    def _watch_stop(self):
        """End this instance's requests at their next step when the server that started this
        stub is gone, or when the file named by ``LADE_TRITON_STOP_FILE`` appears (the local
        runner creates it as it stops the server). Triton 2.51 calls :meth:`finalize` only once
        a decoupled model's requests have ended, so without this a long request kept the
        server's stop waiting for its exit timeout, and outlived a killed server."""
        parent, stop_file = os.getppid(), os.environ.get("LADE_TRITON_STOP_FILE")
        while not self.closing.wait(0.2):
            if os.getppid() != parent or (stop_file and os.path.exists(stop_file)):
                self.closing.set()

    def finalize(self):
        self.closing.set()
        self.pool.shutdown(wait=True)
        self.model.close()
