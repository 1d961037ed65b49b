"""How a parameter-sharing base declares itself: :func:`register_base` registers a base's config model and a
builder that passes it the options every base has and wraps it in FedLAG when the config has a
``[method.fedlag]`` table. Above both :mod:`~fedtailor.methods.pfl.local` and :mod:`~fedtailor.methods.pfl.fedlag`,
so neither imports the other's dependents."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedtailor.fl.method import Method
from fedtailor.fl.registry import MethodSpec, register_method
from fedtailor.fl.setup import train_sizes
from fedtailor.methods.pfl.fedlag import FedLAG
from fedtailor.methods.pfl.local import LocalSGDConfig, LocalTraining
from fedtailor.methods.pfl.private import ClientDP, RecordDP, ServerDP


def register_base(
    config: type[LocalSGDConfig],
    method: Callable[..., LocalTraining],
    options: tuple[str, ...] = (),
    *,
    fedlag: bool = True,
) -> MethodSpec:
    """Register a parameter-sharing base: its name is ``config``'s ``name`` default, its builder calls
    ``method(**common, **{o: cfg.o for o in options})`` with the options every base has, and wraps it in
    FedLAG when the config has a ``[method.fedlag]`` section (``fedlag``: FedLAG can wrap it)."""
    name = config.model_fields["name"].default

    def build(setup: Any) -> Method:
        m = setup.cfg.method
        base = method(
            model_fn=setup.model_fn(m.model),
            lr=m.lr,
            local_epochs=m.local_epochs,
            batch_size=m.batch_size,
            momentum=m.momentum,
            seed=setup.cfg.seed,
            device=setup.device,
            rounds=setup.cfg.federation.rounds,
            vectorize=m.vectorize,
            workers=m.workers,
            train_sizes=train_sizes(setup.clients),
            update_bound=m.update_bound,
            update_bound_mode=m.update_bound_mode,
            unseen=[c for c, d in setup.clients.items() if not d.seen],
            unseen_finetune_epochs=m.unseen_finetune_epochs,
            **{o: getattr(m, o) for o in options},
        )
        if sum(x is not None for x in (m.client_dp, m.record_dp, m.server_dp)) > 1:
            raise ValueError("choose one of [method.client_dp], [method.record_dp] and [method.server_dp].")
        if m.server_dp is not None and m.fedlag is not None:
            raise ValueError(
                "[method.fedlag] with [method.server_dp]: FedLAG's conflict score reads each client's update, which "
                "the server's noise does not cover; use [method.client_dp] (each client's own noise) under FedLAG."
            )
        if m.server_dp is not None:
            seen = [c for c, d in setup.clients.items() if d.seen]
            base = ServerDP(base, cfg=m.server_dp, schedule=setup.schedule, seed=setup.cfg.seed, clients=seen)
        if m.client_dp is not None:
            clients = sorted(setup.clients)
            base = ClientDP(base, cfg=m.client_dp, schedule=setup.schedule, seed=setup.cfg.seed, clients=clients)
        if m.record_dp is not None:
            sizes = train_sizes(setup.clients)
            base = RecordDP(base, cfg=m.record_dp, schedule=setup.schedule, seed=setup.cfg.seed, sizes=sizes)
        if m.fedlag is None:
            return base
        f = m.fedlag
        if m.record_dp is not None and m.record_dp.codec != "fp32" and f.top_k > 0:
            raise ValueError(
                "[method.fedlag] with record_dp.codec: FedLAG's personal layers would stop being sent after the "
                "warm-up, while the codec sends one step of every shared value; set method.fedlag.top_k = 0."
            )
        if (m.client_dp or m.record_dp) is not None and (f.rechoose or f.update == "gradient"):
            raise ValueError(
                "[method.fedlag] with [method.client_dp] scores the released (noisy) updates only: rechoose and "
                'update = "gradient" would send unprotected reports; set rechoose = false and update = "delta".'
            )
        lag = FedLAG(
            base,
            top_k=f.top_k,
            xi=f.xi,
            warmup=f.warmup,
            unit=f.unit,
            update=f.update,
            rechoose=f.rechoose,
            choice=f.choice,
            cap=f.cap,
        )
        if (m.client_dp or m.record_dp) is not None and 0 < f.top_k == len(lag.candidates):
            raise ValueError(
                f"[method.fedlag] top_k = {f.top_k} makes every layer {base.name} shares personal after the warm-up, "
                f"so the private release would be empty; set method.fedlag.top_k below {f.top_k}."
            )
        return lag

    return register_method(name, config=config, build=build, family="pfl", data="images", fedlag=fedlag)
