"""pFedDPO, vanilla FedDPO and centralized DPO on the shared loop.

pFedDPO (*Personalized Federated Direct Preference Optimization via LoRA Adapters*, Z. Jiang and S. Sarkar,
2026, arXiv:2610.12885; the setting of its hh-rlhf appendix):
every client holds a private LoRA adapter ``phi_i`` on top of a shared base ``theta`` that FedAvg aggregates.

Round ``r``, client ``i`` (DPO objective of :mod:`fedtailor.lm.dpo`, reference = the initial model, its
log-probabilities computed once per pair in the setup phase and cached on the client):

1. the server broadcasts ``theta^r``; the client restores ``phi_i`` and its AdamW moments;
2. ``E`` local AdamW steps (lr 1e-4, batch 4, gradient-norm clip 1.0 over base and adapter together) on
   ``theta`` and ``phi_i`` jointly;
3. it uploads its base ``theta_i^{r+1}`` only; ``phi_i`` and its optimizer state never leave it (the server
   refuses any reply that carries other tensors); the server averages the bases (weights: pairs held).

Vanilla FedDPO (*personal = False*) is the same without adapters: the whole model is averaged. Centralized DPO
trains one model on the pooled pairs of the round's clients, ``E`` steps of batch 4 per round, as in the paper's
comparison (it gets a fifth of FedDPO's gradient work per round). One model lives in memory; each client's
adapter is a few hundred thousand numbers, and replies are folded into a running mean as they arrive
(``streaming``), so memory does not grow with the number of clients.

Record-level DP (``[method.record_dp]``, pFedDPO and FedDPO): every local step is pair-level DP-SGD
(:mod:`fedtailor.lm.dpsgd`: Poisson-sampled pairs, each pair's gradient clipped jointly over base and adapter,
the client's own Gaussian noise) in place of the clipped AdamW step; the reply then carries the base and the
public pair count only (no loss, no gradient norm), every release is counted in the run's privacy ledger per
client, the budget guard refuses a schedule or a request that would pass the target, and the summary reports
eps = max over clients against the server (secure randomness) or whoever lacks the seed (simulation).

Optional diagnostics (``diagnostics_every = K``): every K rounds, each client also reports its base gradient at
the received base on a fixed set of its pairs, with adapters disabled and enabled, and its adapter-gradient
norm; the server forms ``kappa^2 = (1/N) sum_i ||g_bar - g_i||^2`` (with the adapted/non-adapted block split)
from running sums. These gradients are outside anything the method promises about what leaves a client, so the
run's summary says they were sent.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from fedtailor.config import Section
from fedtailor.fl.method import Method
from fedtailor.fl.records import ClientData, InvalidMessage, Message, Metrics, TrainingDiverged, check_weight
from fedtailor.fl.registry import register_method
from fedtailor.lm.dpsgd import private_dpo_steps
from fedtailor.lm.training import (
    Tokens,
    dpo_on,
    evaluate_pairs,
    model_digest,
    pairs_digest,
    reference_cache_file,
    reference_cache_folder,
    reference_logprobs,
)
from fedtailor.methods.pfl.local import RecordDPConfig
from fedtailor.methods.pfl.private import calibrate_steps, participations
from fedtailor.privacy.dpsgd import sampling_rate
from fedtailor.privacy.ledger import BudgetGuard, PrivacyLedger
from fedtailor.rng import derive_key, derive_seed, fresh_key, torch_generator


class DPOConfig(Section):
    """pFedDPO and its two baselines (docs/pfeddpo.md); defaults from the paper's hyperparameter table."""

    name: Literal["pfeddpo", "feddpo", "dpo-central"] = "pfeddpo"
    model: str = Field("smollm2", description="'smollm2' (the package on hand), a hub name or a local folder")
    beta: float = Field(0.2, gt=0)
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate")
    local_steps: int = Field(3, ge=1, description="E, local AdamW steps per round")
    batch_size: int = Field(4, ge=1, description="pairs per step")
    grad_clip: float = Field(1.0, gt=0, description="gradient-norm clip over base and adapter together")
    lora_rank: int = Field(8, ge=1)
    lora_alpha: int = Field(16, ge=1)
    precision: Literal["fp32", "bf16"] = Field(
        "bf16",
        description="bf16 autocast over fp32 weights (2.2x faster DPO steps on a CPU with AVX512-BF16 or AMX, 29x "
        "slower on one without, where a run warns; benchmarks/bench_dpo_step.py); fp32 for exact arithmetic",
    )
    diagnostics_every: int = Field(
        0, ge=0, description="kappa^2 diagnostics every K rounds (0: off; opt-in, clients then send base gradients)"
    )
    diagnostic_pairs: int = Field(4, ge=1, description="pairs per client for the diagnostic gradients")
    record_dp: RecordDPConfig | None = Field(
        None,
        description="pair-level DP-SGD in every local step (pfeddpo and feddpo; docs/pfeddpo.md): clip each "
        "pair's gradient over base and adapter jointly, add the client's own Gaussian noise, account per client",
    )
    spill_sum: bool = Field(
        False,
        description="keep a round's running sum of the client bases in a temporary "
        "file between folds: one base less in memory while a client trains, a write and a "
        "read of one base per client more (docs/pfeddpo.md)",
    )


Params = dict[str, torch.Tensor]
DIAG = "diag/"
DPO_MECHANISM = "dpo-dp-sgd"
#: The token arrays of a client's pairs (:func:`fedtailor.lm.preference.tokenize_pairs`), pooled by centralized DPO.
POOL_TOKENS = tuple(f"{side}_{k}" for side in ("chosen", "rejected") for k in ("ids", "attention", "response"))


@dataclass
class DPOServer:
    base: Params  # the shared base theta (every parameter that is not an adapter)
    round: int = 0
    pool: dict[str, torch.Tensor] | None = None  # centralized DPO only: the pooled pairs
    ledger: PrivacyLedger | None = None  # record_dp: every release that reached the server


@dataclass
class DPOClient:
    """What a client keeps: its adapter, the adapter's AdamW moments, and the cached reference log-probs."""

    adapter: Params = field(default_factory=dict)
    moments: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    ref_train: torch.Tensor | None = None  # (n_train, 2)
    ref_eval: dict[str, torch.Tensor] = field(default_factory=dict)  # each evaluation set's, by pairs_digest


@dataclass
class _Fold:
    total: Params  # the running weighted sum of the round's bases (empty while it is spilled to ``spill``)
    spill: Path | None = None  # spill_sum: the sum's file between folds
    weight: float = 0.0
    loss: float = 0.0
    grad_norm: float = 0.0
    diag: dict[str, Any] = field(default_factory=dict)


class PFedDPO(Method[DPOServer, DPOClient]):
    name = "pfeddpo"
    streaming = True
    _spill_cleanup: weakref.finalize | None = None  # removes the open round's spill folder (spill_sum)

    def __init__(
        self,
        *,
        model: Any,
        personal: bool,
        beta: float,
        lr: float,
        local_steps: int,
        batch_size: int,
        grad_clip: float,
        seed: int,
        rounds: int,
        precision: str = "fp32",
        lora_rank: int = 8,
        lora_alpha: int = 16,
        diagnostics_every: int = 0,
        diagnostic_pairs: int = 4,
        spill_sum: bool = False,
        train_sizes: Mapping[int, int] | None = None,
        record_dp: RecordDPConfig | None = None,
        schedule: np.ndarray | None = None,
    ) -> None:
        from fedtailor.lm.model import add_lora

        self.personal = personal
        self.name = "pfeddpo" if personal else "feddpo"
        self.model = (
            add_lora(model, rank=lora_rank, alpha=lora_alpha, seed=derive_seed(seed, "lora-init"))
            if personal
            else model
        )
        self.params = dict(self.model.named_parameters())
        self.adapter_names = tuple(n for n in self.params if "lora_" in n)
        self.base_names = tuple(n for n in self.params if "lora_" not in n)
        self.adapted = frozenset(n for n in self.base_names if _adapted(n))  # base weights under an adapter
        self.adapter0 = {n: self.params[n].detach().clone() for n in self.adapter_names}  # PEFT init, public seed
        self.beta, self.lr, self.local_steps, self.batch_size = beta, lr, local_steps, batch_size
        self.grad_clip, self.seed, self.rounds, self.precision = grad_clip, seed, rounds, precision
        self.diagnostics_every, self.diagnostic_pairs, self.spill_sum = diagnostics_every, diagnostic_pairs, spill_sum
        self.device = next(self.model.parameters()).device
        # what the server knows of each client: its number of training pairs caps its aggregation weight
        self.train_sizes = None if train_sizes is None else {int(c): int(n) for c, n in train_sizes.items()}
        self.dp = record_dp if record_dp is not None and math.isfinite(record_dp.epsilon) else None
        self.noise_multiplier, self.planned = 0.0, {}
        if self.dp is not None:
            if self.train_sizes is None or schedule is None:
                raise ValueError("record_dp needs every client's pair count and the schedule (the accounting plan).")
            self.planned = participations(schedule, sorted(self.train_sizes))
            self.noise_multiplier = self.dp.noise_multiplier or self._calibrate()

    # ----- record-level DP: the plan, the terms of a release, the accounting ----------------------------------
    def _rate(self, cid: int) -> float:
        return sampling_rate(self.train_sizes[cid], self.batch_size)

    def _calibrate(self) -> float:
        """The smallest noise multiplier (to 0.1%) that keeps every client's planned steps within the target."""
        plans = {(self._rate(c), self.local_steps, t) for c, t in self.planned.items()}
        return calibrate_steps(plans, target=self.dp.epsilon, delta=self.dp.delta, conversion=self.dp.conversion)

    def release_terms(self, cid: int) -> dict[str, Any]:
        """A round's release of client ``cid``: ``local_steps`` Poisson-subsampled Gaussian steps."""
        return {
            "sensitivity": self.dp.clip,
            "sigma": self.noise_multiplier * self.dp.clip,
            "sampling_rate": self._rate(cid),
            "steps": self.local_steps,
        }

    def _guard(self, ledger: PrivacyLedger) -> BudgetGuard:
        return BudgetGuard(ledger, target_eps=self.dp.epsilon)

    def _record(self, server: DPOServer, rnd: int, cid: int) -> None:
        """Count the release of ``cid`` in round ``rnd`` once: it left the client, however it is judged after."""
        if self.dp is not None and not server.ledger.recorded(client=cid, round=rnd, mechanism=DPO_MECHANISM):
            self._guard(server.ledger).record(client=cid, round=rnd, mechanism=DPO_MECHANISM, **self.release_terms(cid))

    # ----- helpers ------------------------------------------------------------------------------------
    @torch.no_grad()
    def _load(self, base: Params, adapter: Params | None) -> None:
        for n, t in base.items():
            self.params[n].copy_(t)
        for n in self.adapter_names:
            self.params[n].copy_((adapter or self.adapter0)[n])

    def _adapters_off(self):
        import contextlib

        return self.model.disable_adapter() if self.personal else contextlib.nullcontext()

    def _names(self, reply: Message) -> set[str]:
        return {n for n in reply.arrays if not n.startswith(DIAG)}

    def _diagnose(self, rnd: int) -> bool:
        return bool(self.diagnostics_every) and (rnd % self.diagnostics_every == 0 or rnd == 1)

    # ----- setup: the reference log-probabilities, once per pair --------------------------------------
    def init_server(self) -> DPOServer:
        ledger = None
        if self.dp is not None:  # the whole schedule checked before anything is released
            ledger = PrivacyLedger(delta=self.dp.delta, conversion=self.dp.conversion)
            terms = {c: self.release_terms(c) for c in self.planned}
            self._guard(ledger).check_plan(
                {
                    c: [(t["sensitivity"], t["sigma"], t["sampling_rate"], t["steps"])] * self.planned[c]
                    for c, t in terms.items()
                }
            )
        return DPOServer(base={n: self.params[n].detach().clone() for n in self.base_names}, ledger=ledger)

    def configure_setup(self, server: DPOServer, cid: int) -> Message:
        return Message(arrays=dict(server.base), config={"phase": "reference"})

    def client_setup(self, msg: Message, state: DPOClient | None, data: ClientData) -> tuple[Message, DPOClient]:
        self._load(msg.arrays, None)  # the initial model: theta_0, adapter at its init (B = 0: no change)
        self.model.eval()
        # kept on this client's disk where $FEDTAILOR_REFERENCE_CACHE names a folder, keyed by theta_0's digest
        folder = reference_cache_folder()
        model = model_digest(self.model) if folder else ""

        def reference(tokens: Tokens) -> torch.Tensor:
            where = folder and reference_cache_file(folder, model, tokens, precision=self.precision, device=self.device)
            return reference_logprobs(self.model, tokens, precision=self.precision, cache=where)

        with self._adapters_off():
            ref_train = reference(data.train)
            # the held-out pairs' and the validation pairs' (data.validation_mode = "alongside")
            ref_eval = {pairs_digest(t): reference(t) for t in (data.eval, data.val) if t is not None}
        return Message(config={"pairs": len(ref_train)}), DPOClient(ref_train=ref_train, ref_eval=ref_eval)

    def validate_reply(self, server: DPOServer, phase: str, rnd: int, cid: int, reply: Message) -> None:
        if phase == "setup":
            reply.only(config={"pairs"})
            reply.value("pairs", int)
            return
        self._record(server, rnd, cid)
        names = self._names(reply)
        if names != set(self.base_names):
            extra = sorted(names - set(self.base_names))
            raise InvalidMessage(
                f"a reply must carry exactly the base parameters; unexpected {extra[:3]}, "
                f"missing {len(set(self.base_names) - names)}."
            )
        diag = self._diag_shapes() if self._diagnose(rnd) else {}
        fields = {"num_examples"} if self.dp is not None else {"num_examples", "loss", "base_grad_norm"}
        reply.only(arrays=set(self.base_names) | {DIAG + k for k in diag}, config=fields)
        for n in self.base_names:
            reply.array(n, shape=tuple(server.base[n].shape), dtype=server.base[n].dtype)
        for k, shape in diag.items():  # asked for in this round: exactly these
            reply.array(DIAG + k, shape=shape, dtype=torch.float32)
        check_weight(reply, cid, self.train_sizes)
        if self.dp is None:
            reply.value("loss", float)
            reply.value("base_grad_norm", float)

    def _diag_shapes(self) -> dict[str, tuple[int, ...]]:
        """The diagnostic arrays a client sends in a diagnosed round, by name, with their shapes."""
        n = sum(self.params[name].numel() for name in self.base_names)
        return {"grad_off": (n,), "grad_on": (n,), **({"adapter_sq": (1,)} if self.adapter_names else {})}

    # ----- a round --------------------------------------------------------------------------------------
    def configure_fit(self, server: DPOServer, rnd: int, cid: int) -> Message:
        if self.dp is not None:  # refused here if over budget; recorded when the release arrives
            self._guard(server.ledger).check_release(
                client=cid, round=rnd, mechanism=DPO_MECHANISM, **self.release_terms(cid)
            )
        return Message(arrays=dict(server.base), config={"round": rnd, "diagnose": self._diagnose(rnd)})

    def init_client(self, cid: int) -> DPOClient | None:
        return None

    def batch_order(self, rnd: int, cid: int, n: int) -> torch.Tensor:
        """The E batches of round ``rnd``: E * B distinct pairs (with replacement across batches only when the
        client holds fewer), key (seed, "batches", round, client)."""
        need = self.local_steps * self.batch_size
        gen = torch_generator(self.seed, "batches", rnd, cid)
        reps = -(-need // n)
        return torch.cat([torch.randperm(n, generator=gen) for _ in range(reps)])[:need]

    def client_fit(self, msg: Message, state: DPOClient | None, data: ClientData) -> tuple[Message, DPOClient]:
        if state is None or state.ref_train is None:
            raise ValueError(f"client {data.cid} has no reference log-probabilities: it must take part in setup.")
        rnd = int(msg.config["round"])
        self._load(msg.arrays, state.adapter or None)
        diag = self._diagnostics(data, state) if msg.config.get("diagnose") else {}
        self.model.train()
        opt = self._optimizer(state)
        who = f"round {rnd}: client {data.cid}"
        if self.dp is None:
            order = self.batch_order(rnd, data.cid, len(state.ref_train))
            loss, norm = self._steps(opt, data.train, state.ref_train, order, who)
        else:  # pair-level DP-SGD; the key is the client's own secret in secure mode
            simulation = self.dp.randomness == "simulation"
            key = derive_key(self.seed, "dpo-dp-sgd", rnd, data.cid) if simulation else fresh_key()
            trained = {n: self.params[n] for n in (*self.base_names, *self.adapter_names)}
            loss = private_dpo_steps(
                self.model,
                trained,
                opt,
                data.train,
                state.ref_train,
                steps=self.local_steps,
                batch_size=self.batch_size,
                beta=self.beta,
                clip=self.dp.clip,
                noise_multiplier=self.noise_multiplier,
                key=key,
                precision=self.precision,
                who=who,
            )
        self.model.zero_grad(set_to_none=True)  # the gradients are spent: free them before the reply is folded
        new_state = DPOClient(
            adapter={n: self.params[n].detach().clone() for n in self.adapter_names},
            moments=_moments(opt, self.params, self.adapter_names),
            ref_train=state.ref_train,
            ref_eval=state.ref_eval,
        )
        arrays = {n: self.params[n].detach().clone() for n in self.base_names}
        arrays.update({DIAG + k: v for k, v in diag.items()})
        config = {"num_examples": len(state.ref_train)}
        if self.dp is None:  # training statistics are not DP outputs: sent only without record_dp
            config.update(loss=loss, base_grad_norm=norm)
        return Message(arrays=arrays, config=config), new_state

    def _steps(
        self, opt: torch.optim.Optimizer, tokens: dict, ref: torch.Tensor, order: torch.Tensor, who: str
    ) -> tuple[float, float]:
        """E AdamW steps of batch B in ``order``, one gradient-norm clip over every trained parameter; returns the
        mean DPO loss and the mean base-gradient norm (before clipping)."""
        losses, norms = [], []
        trained = [self.params[n] for n in (*self.base_names, *self.adapter_names)]
        for step in range(self.local_steps):
            idx = order[step * self.batch_size : (step + 1) * self.batch_size]
            out = dpo_on(self.model, tokens, ref, idx, beta=self.beta, precision=self.precision)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            norms.append(_norm([self.params[n].grad for n in self.base_names]))
            torch.nn.utils.clip_grad_norm_(trained, self.grad_clip)
            opt.step()
            losses.append(float(out.loss.detach()))
        if not all(math.isfinite(v) for v in losses):
            raise TrainingDiverged(f"{who}'s DPO loss is {losses}")
        return sum(losses) / len(losses), sum(norms) / len(norms)

    def _optimizer(self, state: DPOClient) -> torch.optim.Optimizer:
        """AdamW over base and adapter; the adapter's moments resume from the client's state (the base's start
        afresh each round: a new base arrives)."""
        params = [self.params[n] for n in (*self.base_names, *self.adapter_names)]
        opt = adamw(params, lr=self.lr)
        for n, m in state.moments.items():
            opt.state[self.params[n]] = {k: v.clone() for k, v in m.items()}
        return opt

    def _diagnostics(self, data: ClientData, state: DPOClient) -> dict[str, torch.Tensor]:
        """Base gradients at the received base on the client's first ``diagnostic_pairs`` pairs, adapters off and
        on, and the adapter gradient's squared norm (opt-in; see the module docstring)."""
        idx = torch.arange(min(self.diagnostic_pairs, len(state.ref_train)))
        out = {}
        for tag, ctx in (("off", self._adapters_off), ("on", _null)):
            self.model.zero_grad(set_to_none=True)
            with ctx():
                dpo_on(
                    self.model, data.train, state.ref_train, idx, beta=self.beta, precision=self.precision
                ).loss.backward()
            out[f"grad_{tag}"] = torch.cat([self.params[n].grad.reshape(-1) for n in self.base_names]).detach().clone()
            if tag == "on" and self.adapter_names:
                out["adapter_sq"] = torch.tensor([_norm([self.params[n].grad for n in self.adapter_names]) ** 2])
        self.model.zero_grad(set_to_none=True)
        return out

    def fold_fit(self, server: DPOServer, rnd: int, acc: _Fold | None, cid: int, reply: Message) -> _Fold:
        w = float(reply.config["num_examples"])
        if acc is None:
            self.close()  # a round abandoned between folds (an error, Ctrl-C) leaves no folder behind
            acc = _Fold(total={})
            acc.spill = self._spill_file(acc) if self.spill_sum else None
        if not acc.total:  # the first fold, or the sum is on disk
            acc.total = (
                _read_sum(acc.spill, self.device)
                if acc.spill is not None and acc.spill.exists()
                else {n: torch.zeros_like(server.base[n]) for n in self.base_names}
            )
        for n in self.base_names:
            acc.total[n].add_(reply.arrays[n], alpha=w)
        if acc.spill is not None:  # off to disk until the next reply: no sum in memory while a client trains
            _write_sum(acc.spill, acc.total)
            acc.total = {}
        acc.weight += w
        if self.dp is None:
            acc.loss += w * float(reply.config["loss"])
            acc.grad_norm += w * float(reply.config["base_grad_norm"])
        if DIAG + "grad_off" in reply.arrays:
            _fold_diag(acc.diag, reply, self._adapted_mask(server))
        return acc

    def aggregate_fit(self, server: DPOServer, rnd: int, replies: dict[int, Message]) -> tuple[DPOServer, Metrics]:
        """The same as folding the replies one by one (for drivers that collect a round's replies first)."""
        acc = None
        for cid in sorted(replies):
            acc = self.fold_fit(server, rnd, acc, cid, replies[cid])
        return self.finish_fit(server, rnd, acc)

    def _adapted_mask(self, server: DPOServer) -> torch.Tensor:
        return torch.cat([torch.full((server.base[n].numel(),), n in self.adapted) for n in self.base_names])

    def finish_fit(self, server: DPOServer, rnd: int, acc: _Fold) -> tuple[DPOServer, Metrics]:
        if acc.spill is not None:
            acc.total = _read_sum(acc.spill, self.device)
            shutil.rmtree(acc.spill.parent, ignore_errors=True)
            self.close()
        base = {n: t / acc.weight for n, t in acc.total.items()}
        metrics = (
            {} if self.dp is not None else {"loss": acc.loss / acc.weight, "base_grad_norm": acc.grad_norm / acc.weight}
        )
        metrics.update(_kappa(acc.diag))
        return DPOServer(base=base, round=rnd, pool=server.pool, ledger=server.ledger), metrics

    def _spill_file(self, owner: _Fold) -> Path:
        """The file of a round's spilled sum, in a fresh temporary folder that is removed on every exit: when
        the round finishes, when the next round starts or the method is closed (the runner closes it however
        the run ends), when ``owner`` (the round's accumulator) is dropped, and at interpreter exit."""
        folder = Path(tempfile.mkdtemp(prefix="fedtailor-sum-"))
        self._spill_cleanup = weakref.finalize(owner, shutil.rmtree, str(folder), True)
        return folder / "sum.safetensors"

    def close(self) -> None:
        """Remove the spill folder of a round that did not finish (spill_sum); nothing else to release."""
        if self._spill_cleanup is not None:
            self._spill_cleanup()  # a finalizer runs once: later calls do nothing
            self._spill_cleanup = None

    # ----- evaluation -----------------------------------------------------------------------------------
    def configure_evaluate(self, server: DPOServer, cid: int) -> Message:
        return Message(arrays=dict(server.base))

    def client_evaluate(self, msg: Message, state: DPOClient | None, data: ClientData) -> Metrics:
        if state is None or state.ref_train is None:
            raise ValueError(f"client {data.cid} has no reference log-probabilities: it must take part in setup.")
        self._load(msg.arrays, state.adapter or None)
        self.model.eval()
        out = {"num_examples": float(len(state.ref_train))}
        if data.train is not None:  # None in the validation pass (fedtailor.fl.loop.evaluate_client)
            acc, loss = evaluate_pairs(
                self.model, data.train, state.ref_train, beta=self.beta, precision=self.precision
            )
            out.update({"train_accuracy": acc, "train_loss": loss})
        if data.eval is not None:
            ref = state.ref_eval.get(pairs_digest(data.eval))
            if ref is None:
                raise ValueError(f"client {data.cid} has no reference log-probabilities of its evaluation pairs.")
            acc, loss = evaluate_pairs(self.model, data.eval, ref, beta=self.beta, precision=self.precision)
            out.update({"accuracy": acc, "loss": loss})
        return out

    def deployment_risks(self) -> dict[str, str]:
        risks = {}
        if self.diagnostics_every:
            risks["diagnostics"] = "method.diagnostics_every > 0: clients send base gradients on their own pairs"
        if self.dp is not None and self.dp.randomness == "simulation":
            risks["simulation-randomness"] = "DP randomness is 'simulation': every noise draw follows from the seed"
        return risks

    def artifacts(self, server: DPOServer) -> dict[str, str]:
        return {"privacy_ledger.json": server.ledger.to_json()} if server.ledger is not None else {}

    def summary(self, server: DPOServer) -> dict[str, Any]:
        out = {
            "adapters": "private LoRA, never uploaded" if self.personal else "none",
            "adapter_parameters_per_client": sum(self.params[n].numel() for n in self.adapter_names),
            "base_parameters": sum(t.numel() for t in server.base.values()),
            "diagnostics_sent": bool(self.diagnostics_every),
        }
        if self.dp is not None:
            eps = server.ledger.epsilons()
            void = (
                ["diagnostics on: clients send base gradients outside the DP steps"] if self.diagnostics_every else []
            )
            simulation = self.dp.randomness == "simulation"
            out.update(
                {
                    "dp": "record-level (pair-level DP-SGD, base and adapter clipped jointly)",
                    "noise_multiplier": self.noise_multiplier,
                    "clip": self.dp.clip,
                    "epsilon_target": self.dp.epsilon,
                    "epsilon_max": max(eps.values()) if eps else 0.0,
                    "epsilon_conversion": self.dp.conversion,
                    "delta": self.dp.delta,
                    "epsilon_per_client": {str(c): e for c, e in sorted(eps.items())},
                    "randomness": self.dp.randomness,
                    "epsilon_holds_against": "whoever does not know the config's seed"
                    if simulation
                    else "the server (state, checkpoints, logs) and every output: each client's noise from its own key",
                    "epsilon_void": bool(void),
                    "epsilon_void_reasons": void,
                    "releases": len(server.ledger.releases),
                }
            )
        return out


class CentralizedDPO(PFedDPO):
    """Centralized DPO: the clients hand their pairs (tokens and cached reference log-probabilities) to the
    server once, in the setup phase; every round the server takes ``E`` AdamW steps of batch ``B`` on the pool
    (key (seed, "batches", round, "pool")); every client is evaluated with that one model. No adapters."""

    def __init__(self, *, pair_length: int | None = None, **kw: Any) -> None:
        super().__init__(personal=False, **kw)
        self.name = "dpo-central"
        self.pair_length = pair_length  # tokens per sequence (data.max_length): every pooled array's width

    def client_setup(self, msg: Message, state: DPOClient | None, data: ClientData) -> tuple[Message, DPOClient]:
        reply, state = super().client_setup(msg, state, data)
        arrays = {f"pool/{k}": v for k, v in data.train.items()}
        arrays["pool/ref"] = state.ref_train
        return Message(arrays=arrays, config=reply.config), state

    def validate_reply(self, server: DPOServer, phase: str, rnd: int, cid: int, reply: Message) -> None:
        if phase == "setup":
            reply.only(arrays={f"pool/{k}" for k in POOL_TOKENS} | {"pool/ref"}, config={"pairs"})
            n = reply.value("pairs", int)
            if n <= 0:
                raise InvalidMessage(f"a centralized setup reply must hold at least one pair, got {n}.")
            reply.array("pool/ref", shape=(n, 2), dtype=torch.float32)
            vocab = self.model.get_input_embeddings().num_embeddings
            width = self.pair_length or reply.array(f"pool/{POOL_TOKENS[0]}", dtype=torch.long).shape[-1]
            for k in POOL_TOKENS:  # token ids the model can embed, 0/1 masks, one width for every array
                t = reply.array(f"pool/{k}", shape=(n, width), dtype=torch.long)
                top = vocab if k.endswith("_ids") else 2
                if t.numel() and (int(t.min()) < 0 or int(t.max()) >= top):
                    raise InvalidMessage(f"pool/{k} holds values outside [0, {top}).")
            return
        reply.only(config={"num_examples"})
        check_weight(reply, cid, self.train_sizes)

    def aggregate_setup(self, server: DPOServer, replies: dict[int, Message]) -> DPOServer:
        widths = {r.arrays[f"pool/{POOL_TOKENS[0]}"].shape[-1] for r in replies.values()}
        if len(widths) > 1:  # only without pair_length: each reply was fine alone, the pool needs one width
            raise ValueError(
                f"the clients' pairs have different lengths {sorted(widths)}; set one data.max_length for every client."
            )
        keys = sorted({k for r in replies.values() for k in r.arrays})
        pool = {k[len("pool/") :]: torch.cat([replies[c].arrays[k] for c in sorted(replies)]) for k in keys}
        return DPOServer(base=server.base, round=server.round, pool=pool)

    def client_fit(self, msg: Message, state: DPOClient | None, data: ClientData) -> tuple[Message, DPOClient]:
        return Message(config={"num_examples": len(data.train["chosen_ids"])}), state

    def fold_fit(self, server: DPOServer, rnd: int, acc: Any, cid: int, reply: Message) -> Any:
        return (acc or 0) + 1

    def finish_fit(self, server: DPOServer, rnd: int, acc: Any) -> tuple[DPOServer, Metrics]:
        pool = dict(server.pool)
        ref = pool.pop("ref")
        self._load(server.base, None)
        self.model.train()
        opt = adamw([self.params[n] for n in self.base_names], lr=self.lr)
        order = self.batch_order(rnd, -1, len(ref))
        loss, norm = self._steps(opt, pool, ref, order, f"round {rnd}: centralized DPO")
        base = {n: self.params[n].detach().clone() for n in self.base_names}
        return (DPOServer(base=base, round=rnd, pool=server.pool), {"loss": loss, "base_grad_norm": norm})


# ----- small pure helpers ---------------------------------------------------------------------------------
def _write_sum(path: Path, total: Params) -> None:
    from safetensors.torch import save_file

    save_file({n: t.detach().cpu().contiguous() for n, t in total.items()}, str(path))


def _read_sum(path: Path, device: torch.device) -> Params:
    from safetensors.torch import load_file

    return load_file(str(path), device=str(device))


def adamw(params: list[torch.Tensor], *, lr: float) -> torch.optim.Optimizer:
    """AdamW without weight decay, fused (one kernel over all tensors: about 3x faster on the CPU than the
    per-tensor loop, benchmarks/bench_dpo_step.py) where the device supports it."""
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True)


def _adapted(name: str) -> bool:
    """A base weight that sits under a LoRA adapter (PEFT renames it ``...<proj>.base_layer.weight``)."""
    return ".base_layer." in name


def _null():
    import contextlib

    return contextlib.nullcontext()


def _norm(grads: list[torch.Tensor | None]) -> float:
    return math.sqrt(sum(_sq(g) for g in grads if g is not None))


ROW = 1024  # entries per float32 partial sum of _sq


def _sq(g: torch.Tensor) -> float:
    """||g||^2 to float32 rounding (about 1e-7 relative) at the speed of one float32 pass: float32 norms of rows of
    ``ROW`` entries, combined in float64. (One float32 norm of a 28M-entry embedding gradient is off by up to 1% on
    CPU, where the sum runs in a few long lanes; a float64 norm is as accurate as this but 12x slower.)"""
    flat = g.detach().reshape(-1)
    cut = flat.numel() - flat.numel() % ROW
    dtype = torch.promote_types(flat.dtype, torch.float32)
    rows = torch.linalg.vector_norm(flat[:cut].view(-1, ROW), dim=1, dtype=dtype)
    return float(rows.double().square().sum() + flat[cut:].double().square().sum())


def _moments(opt: torch.optim.Optimizer, params: Params, names: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for n in names:
        st = opt.state.get(params[n], {})
        if st:
            out[n] = {k: (v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)) for k, v in st.items()}
    return out


def _fold_diag(diag: dict[str, Any], reply: Message, adapted: torch.Tensor) -> None:
    """Running sums for kappa^2 = (1/N) sum ||g_i||^2 - ||g_bar||^2 (adapters off, on; adapted/other blocks): the
    sums of the gradients in float32, their squared norms in float64."""
    diag["n"] = diag.get("n", 0) + 1
    for tag in ("off", "on"):
        g = reply.arrays[DIAG + f"grad_{tag}"]
        if f"sum_{tag}" in diag:
            diag[f"sum_{tag}"].add_(g)
        else:
            diag[f"sum_{tag}"] = g.clone()
        diag[f"sq_{tag}"] = diag.get(f"sq_{tag}", 0.0) + _sq(g)
        if tag == "off":
            diag["sq_off_A"] = diag.get("sq_off_A", 0.0) + _sq(g[adapted])
            diag["mask"] = adapted
    if DIAG + "adapter_sq" in reply.arrays:
        diag["adapter_sq"] = diag.get("adapter_sq", 0.0) + float(reply.arrays[DIAG + "adapter_sq"].sum())


def _kappa(diag: dict[str, Any]) -> Metrics:
    if not diag:
        return {}
    n = diag["n"]
    out = {}
    for tag, key in (("off", "kappa2"), ("on", "kappa2_eff")):
        mean_sq = _sq(diag[f"sum_{tag}"]) / n**2  # ||g_bar||^2
        out[key] = diag[f"sq_{tag}"] / n - mean_sq
        # The paper's scale-free reading: kappa^2 relative to the squared norm of the mean gradient.
        out[f"{key}_rel"] = out[key] / mean_sq if mean_sq > 0 else float("nan")
    out["kappa2_adapted"] = diag["sq_off_A"] / n - _sq(diag["sum_off"][diag["mask"]]) / n**2
    out["kappa2_other"] = out["kappa2"] - out["kappa2_adapted"]
    if "adapter_sq" in diag:
        out["adapter_grad_sq_mean"] = diag["adapter_sq"] / n
    return out


def build_dpo_method(setup: Any) -> PFedDPO | CentralizedDPO:
    """pFedDPO, vanilla FedDPO or centralized DPO on a preference setup
    (:class:`fedtailor.lm.setup.PreferenceSetup`)."""
    m = setup.cfg.method
    kw = {
        "model": setup.model,
        "beta": m.beta,
        "lr": m.lr,
        "local_steps": m.local_steps,
        "batch_size": m.batch_size,
        "grad_clip": m.grad_clip,
        "seed": setup.cfg.seed,
        "rounds": setup.cfg.federation.rounds,
        "precision": m.precision,
        "lora_rank": m.lora_rank,
        "lora_alpha": m.lora_alpha,
        "diagnostics_every": m.diagnostics_every,
        "diagnostic_pairs": m.diagnostic_pairs,
        "spill_sum": m.spill_sum,
        "train_sizes": {cid: len(d.train["chosen_ids"]) for cid, d in setup.clients.items()},
    }
    if m.name == "dpo-central":
        if m.record_dp is not None:
            raise ValueError(
                "method.record_dp with dpo-central: the clients hand their pairs to the server, so there is no client "
                "release to protect; use pfeddpo or feddpo."
            )
        return CentralizedDPO(pair_length=setup.cfg.data.max_length, **kw)
    return PFedDPO(personal=m.name == "pfeddpo", record_dp=m.record_dp, schedule=setup.schedule, **kw)


for _name in ("pfeddpo", "feddpo", "dpo-central"):
    register_method(_name, config=DPOConfig, build=build_dpo_method, family="dpo", data="preferences")
