"""cancel-sidecar: a reverse proxy that stops LLM engine work the moment its client leaves.

Data flow for one request (modules named after the nouns)::

    client request ──► front door (door.py: admitted or refused, then to the proxy or the
                       tunnel; ticket.py: the sidecar request id, access line and counts)
                   ──► route (route.py: longest prefix -> engine, and the engines to abort)
                   ──► engine adapter tags ids (engine/: X-Request-Id, or a body field such
                       as SGLang's rid, = a sidecar-minted id)
                   ──► upstream request (upstream.py: sent, re-sent once after a stale
                       connection) and its response (relay.py: engine connections as asyncio
                       protocols; each body piece goes from the engine's socket to the
                       client's transport in the read callback; pool.py keeps them alive,
                       read_pacer.py holds their reads while clients leave)
    client disconnect (aiohttp cancels the handler: proxy.py's Exchange, one request's life;
                       cancellation.py: its early end, what the sidecar does in between)
                   ──► upstream closed + engine abort (plan.py: which ids at which engines, by
                       pure functions; abort.py: own task, bounded, counted, its queues
                       in abort_queue.py, one call and its retries in abort_call.py;
                       one per abort engine of the route, concurrently, and one at the engine
                       a request header names if allowed: targets.py, llm-d's prefill pod)

An upgrade request (``Connection: Upgrade``: a WebSocket such as vLLM's ``/v1/realtime``) leaves
that flow after the route: ``tunnel.py`` relays the engine's ``101`` and then splices the two
sockets byte for byte; either side's close or reset closes the other at once, never an abort
(``tunnel_wire.py``: the engine's connection and its head's parser, the client's side).

What the sidecar writes to a client itself (its JSON errors and refusals, the end of a request it
cancels or times out) is built in ``replies.py``; the header names it reads and writes, and the
hop-by-hop rewriting, are ``headers.py``'s.

``config/`` turns YAML into frozen settings; ``runtime.py`` turns settings into one swappable
generation (adapters, router, upstream pool; SIGHUP swaps it) and counts requests in flight;
``app.py`` builds the proxy and admin applications with their state under typed keys
(``keys.py``, or beside the class a key types); ``server.py`` runs them as production does and
drains them on SIGTERM; ``workers.py`` supervises ``--workers N`` processes on one port;
``cli.py`` is the ``cancel-sidecar`` command; ``cancel.py`` is the admin listener's cancel API
(the same abort path, asked by an operator); ``readiness.py`` checks that each engine answers
and can abort (``/readyz`` and the startup check), saying what to fix.
"""
