"""``lade-export serve`` (the OpenAI HTTP API over continuous batching,
:mod:`lade_export.serving.openai_api`) and ``triton`` (a Triton Inference Server model
repository, :mod:`lade_export.serving.repository`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import ProfileError
from .common import (_address, _artifact_dir, _engine_threads, _finite, _kv_tokens, _model_name, _token_budget,
                     _width_policy, _writable_folder, main)


#: Most ``--instances`` and ``--threads`` triton writes: a fixed bound (the repository is served
#: on another machine, whose CPUs and GPUs this one does not know) that stops typos before
#: Triton's int32 instance count or ONNX Runtime's thread option overflow.
TRITON_MOST = 1024


@main.command()
@_artifact_dir
@click.option("--out", "repository", required=True, type=click.Path(path_type=Path), callback=_writable_folder,
              help="Triton model repository (created if missing; other models in it are kept).")
@click.option("--name", default=None, help="Model name (default: from the artifact's source model).")
@click.option("--instances", type=click.IntRange(min=1, max=TRITON_MOST), default=1, show_default=True,
              help="Model instances (one Triton stub process each; per GPU with --device cuda).")
@click.option("--profile", "profile_values", multiple=True,
              help="Profile clients may name (repeatable; the first is the default; default: the artifact's). "
                   "'greedy' is always served.")
@click.option("--backend", type=click.Choice(["ort", "tensorrt"]), default="ort", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Default: cpu for ort, cuda for tensorrt.")
@click.option("--max-new-tokens-limit", type=int, default=None,
              help="Most new tokens a request may ask for (default: the context minus one).")
@click.option("--default-max-new-tokens", type=click.IntRange(min=1), default=None,
              help="For requests without max_new_tokens (default: min(256, limit)).")
@click.option("--max-concurrent-requests", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests one instance decodes at once, sharing its scheduler's passes (more wait).")
@click.option("--no-batching", is_flag=True,
              help="Each request runs its own passes instead of the instance's scheduler (always so with tensorrt).")
@_token_budget
@_kv_tokens(help="Scheduler: most tokens an instance's KV pool holds over its requests (default: "
                 "max-concurrent-requests x the model's context).")
@_width_policy
@click.option("--threads", type=click.IntRange(min=0, max=TRITON_MOST), default=0, show_default=True,
              help="Engine threads per instance (0: the engine's default).")
@click.option("--copy-artifact", is_flag=True, help="Copy the artifact into the repository instead of referencing it.")
@click.option("--artifact-path", default=None, help="The artifact's path as the server sees it (a mounted volume).")
@click.option("--force", is_flag=True, help="Replace REPO/NAME if this command wrote it.")
def triton(artifact_dir, repository, name, instances, profile_values, backend, device, max_new_tokens_limit,
           default_max_new_tokens, max_concurrent_requests, no_batching, token_budget, kv_tokens, width_policy,
           threads, copy_artifact, artifact_path, force):
    """Write a Triton Inference Server model (Python backend, streamed responses) for an artifact
    (docs/serving.md)."""
    from ..serving.repository import serve_hints, write_model_repository

    out = write_model_repository(
        artifact_dir, repository, name=name, instances=instances, profiles=profile_values, backend=backend,
        device=device, max_new_tokens_limit=max_new_tokens_limit, default_max_new_tokens=default_max_new_tokens,
        max_concurrent_requests=max_concurrent_requests, threads=threads, copy_artifact=copy_artifact,
        artifact_path=artifact_path, force=force, batching=False if no_batching else None,
        token_budget=token_budget, kv_tokens=kv_tokens, width_policy=width_policy)
    click.echo(f"wrote {out} (model {out.name!r})")
    for line in serve_hints(out.parent):
        click.echo(line)


@main.command()
@_artifact_dir
@click.option("--host", default="127.0.0.1", show_default=True, callback=_address,
              help="Address to listen on (localhost only unless told otherwise; 0.0.0.0 for every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="TCP port (0: a free one, printed at start).")
@click.option("--profile", "profile_values", multiple=True,
              help="Lookahead profile requests may pick (repeatable; the first is the default; default: the "
                   "artifact's).")
@click.option("--model-name", default=None, callback=_model_name,
              help="The model id clients send (default: the artifact folder's name).")
@click.option("--api-key-env", default=None, metavar="VAR",
              help="Environment variable holding the API key clients must send (Authorization: Bearer KEY).")
@click.option("--max-concurrent", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests decoded at once, sharing the scheduler's passes.")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests waiting for a slot; one more is answered 429.")
@click.option("--max-new-tokens-limit", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Largest max_tokens a request may ask (also the default, capped by the context left).")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=1 << 20, show_default=True,
              help="Largest request body (413 beyond).")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True, callback=_finite,
              help="On SIGTERM, seconds the requests in flight may take to finish before they are cancelled "
                   "(each stream then ends with a server_shutdown error event, other requests get a 503).")
@_token_budget
@_kv_tokens(help="Scheduler: most tokens the KV pool holds over all requests (default: max-concurrent x the "
                 "model's context).")
@_width_policy
@_engine_threads
def serve(artifact_dir, host, port, profile_values, model_name, api_key_env, max_concurrent, max_queue,
          max_new_tokens_limit, max_body_bytes, drain_timeout, token_budget, kv_tokens, width_policy, threads):
    """Serve an artifact over the OpenAI HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics) with continuous batching (docs/serving.md)."""
    import os

    from .. import load
    from ..errors import ServingError
    from ..serving.openai_api import OpenAIServer, ServerConfig, bind, run

    api_key = None
    if api_key_env is not None:
        api_key = os.environ.get(api_key_env, "")
        if not api_key.strip():
            raise ServingError(f"--api-key-env {api_key_env}: the environment variable {api_key_env} is not set "
                               "or empty; set it to the key clients must send")
    sock = bind(host, port)
    try:
        # every running request gets a place in the passes
        model = load(artifact_dir, batching=True, threads=threads, max_batch=max_concurrent,
                     token_budget=token_budget, kv_tokens=kv_tokens, width_policy=width_policy)
        profiles = {}
        for value in profile_values or (None,):
            prof = model.resolve_profile(value)
            if prof.name in profiles:
                raise ProfileError(f"profile {prof.name!r} is given twice; each --profile needs its own name")
            model.decoder.check_request(1, 1, prof)
            profiles[prof.name] = prof
        name = model_name or Path(artifact_dir).resolve().name
        server = OpenAIServer(model, ServerConfig(name, profiles, api_key, max_concurrent, max_queue,
                                                  max_new_tokens_limit, max_body_bytes))
        where = sock.getsockname()
        sched = model.scheduler
        click.echo(f"serving {name!r} at http://{host}:{where[1]}/v1 (profiles: {', '.join(profiles)}; "
                   f"{max_concurrent} at once, {max_queue} waiting{'; API key required' if api_key else ''}; "
                   f"scheduler: token budget {sched.token_budget}, KV pool {sched.kv_tokens} tokens, "
                   f"width policy {sched.width_policy.name})", nl=True)
        sys.stdout.flush()
        code = run(server, sock, drain_s=drain_timeout)
    finally:
        sock.close()
    model.close()
    if code:
        sys.exit(code)
