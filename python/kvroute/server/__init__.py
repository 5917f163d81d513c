"""Parts every kvroute server shares (``kvroute serve``, ``kvroute epp``, the event relay).

- ``config`` — the TOML loader: typed tables, the fleet's sections (workers, router, tokenizer,
  events, health), key digests;
- ``routing`` — the Router built from that configuration, and what ``route`` raises when no
  worker is left;
- ``health`` — the health model: ejection on failures, readmission by probing;
- ``events`` — the KV-event subscriber of a server in events mode;
- ``metrics`` — Prometheus counters, gauges and histograms on one registry;
- ``tasks`` — background tasks cancelled and awaited when a server stops;
- ``warm`` — what a dedicated endpoint keeps warm, learnt from its requests (the gateway's and the
  simulator's one rule).

Nothing here imports an HTTP, gRPC or NATS library (zmq only when events mode starts): a server
brings its own transport.
"""
