"""An engine wrapped for a test: it hands the whole engine interface (:class:`lade_export.runtime.Engine`)
to the wrapped engine, and a subclass changes ``run`` (a delay, a failure, a counter)."""


class WrappedEngine:
    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):  # name, dims, kv_layout, check_profile, …: the wrapped engine's
        return getattr(self.engine, name)

    def run(self, feeds, with_logits=False):
        return self.engine.run(feeds, with_logits)
