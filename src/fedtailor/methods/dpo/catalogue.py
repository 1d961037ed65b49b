"""The pFedDPO paper's experiments for ``fedtailor reproduce``, on ``configs/pfeddpo/hh-rlhf.toml`` (HH-RLHF with
SmolLM2): pFedDPO against vanilla FedDPO and centralized DPO, and the LoRA-rank and participation ablations."""

from __future__ import annotations

from fedtailor.fl.experiments import Block, Experiment, register_experiment

# --quick for pFedDPO: 2 rounds of one local step on 8 pairs per client
DPO_QUICK = (
    "federation.rounds=2",
    "method.local_steps=1",
    "data.pairs_per_client=8",
    "data.heldout_pairs=4",
    "federation.eval_every=0",
)
DPO_METRICS = ("seen/train_accuracy", "seen/accuracy", "seen/loss")

register_experiment(
    Experiment(
        "pfeddpo-hh",
        "pFedDPO against vanilla FedDPO and centralized DPO on HH-RLHF with SmolLM2 (the "
        "federated methods log kappa^2 every 10 rounds)",
        (
            Block(
                "federated",
                "configs/pfeddpo/hh-rlhf.toml",
                (("method.name", ("pfeddpo", "feddpo")),),
                ("method.diagnostics_every=10",),
            ),
            Block("central", "configs/pfeddpo/hh-rlhf.toml", (("method.name", ("dpo-central",)),)),
        ),
        quick=DPO_QUICK,
        metrics=DPO_METRICS,
        seeds=(41,),
        reference=("method.name", "pfeddpo"),  # FedDPO and centralized DPO against pFedDPO, client by client
    ),
    Experiment(
        "pfeddpo-rank",
        "pFedDPO's LoRA rank (4, 8, 16) on HH-RLHF with SmolLM2, 10 rounds",
        (
            Block(
                "rank",
                "configs/pfeddpo/hh-rlhf.toml",
                (("method.lora_rank", ("4", "8", "16")),),
                ("federation.rounds=10",),
            ),
        ),
        quick=DPO_QUICK,
        metrics=DPO_METRICS,
        seeds=(41,),
        x_axis="lora_rank",
        log_x=True,
    ),
    Experiment(
        "pfeddpo-participation",
        "pFedDPO with S = 2, 3, 5 of the 5 clients per round on HH-RLHF with SmolLM2, 10 rounds",
        (
            Block(
                "participation",
                "configs/pfeddpo/hh-rlhf.toml",
                (("federation.clients_per_round", ("2", "3", "5")),),
                ("federation.rounds=10",),
            ),
        ),
        quick=DPO_QUICK,
        metrics=DPO_METRICS,
        seeds=(41,),
        x_axis="clients_per_round",
    ),
    module=__name__,
)
