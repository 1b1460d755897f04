"""A part's state: what a joining replica downloads (parameters, optimizer state, the recent steps'
members and coverage), in shards from several donors, and how it is checked and loaded.

PartState is a piece of peer.model.part.PartRuntime: its methods use the runtime's parameters,
optimizer, history and accumulator, and run on the owner's torch thread like the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from peer.model.fingerprint import first_difference
from peer.model.numerics import all_finite

OPTIMIZER_SLOTS = ("exp_avg", "exp_avg_sq", "step")  # AdamW's state of each parameter, as a state names it


class StateError(ValueError):
    """A downloaded state that does not fit this part."""


class OutOfReach(StateError):
    """A donor's weights are further from ours than the steps it claims to be ahead could have moved them."""


class Poisoned(StateError):
    """A state no honest replica holds: parameters or optimizer state not finite, a negative second moment, a
    step count below one, another step than the one asked for. Its donor is not asked again."""


@dataclass
class Fingerprint:
    epoch: int  # the optimizer step this fingerprint follows (epoch after the step)
    samples: int  # samples the step accounted over the whole averaging group
    # per parameter: sum, then sum of squares; then those of its optimizer state (state_fingerprint)
    values: list[float]
    members: list[str] = field(default_factory=list)  # peer ids of the averaging group; empty: unknown
    # peer id -> (incarnation, seq): the step counted that member's accumulator additions up to seq
    coverage: dict[str, tuple[int, int]] = field(default_factory=dict)


STEP_MEMBERS = 32  # recent steps whose group members and coverage travel with a state


class PartState:
    """State transfer of a PartRuntime (which inherits it): snapshot, check and load a donor's state."""

    def _drop_what_the_donor_counted(self, step: Fingerprint | None, me: str) -> None:
        if step is None:
            return
        if me in step.coverage:
            self.drop_covered(*step.coverage[me])
        elif me in step.members and not step.coverage:  # a donor too old to say: it counted the whole take
            self.drop_covered(self.incarnation, max(r.seq for r in self.restored))

    def _inherit_history(self, steps: dict[int, Fingerprint], last_samples: int) -> None:
        """After a load: the donor's recent steps (members and coverage; values unknown, empty) replace
        our entries from the first of them on (ours are kept where we made the step too), and the loaded
        step carries our fingerprint of the donor's parameters. A replica that resynced past a round can
        so still say what that round counted."""
        own = {f.epoch: f for f in self.history if f.values}  # steps we made too: the same, with real values
        first = min(steps, default=self.epoch)
        kept = [f for f in self.history if f.epoch < first]
        inherited = [_same_step(own.get(e), f) for e, f in sorted(steps.items()) if e < self.epoch]
        loaded = steps.get(self.epoch, Fingerprint(self.epoch, 0, []))
        checked, self._checked_values = self._checked_values, None
        loaded.samples, loaded.values = last_samples, checked or self.fingerprint_values()
        self.history.clear()
        self.history.extend([*kept, *inherited, loaded])

    @torch.no_grad()
    def fingerprint_values(self) -> list[float]:
        """This replica's `state_fingerprint`: of the anchor in local mode (the replicas' common point)."""
        return state_fingerprint(self.state_tensors(), self.param_names, self.local)

    def latest_fingerprint(self) -> list[float]:
        """The fingerprint of the parameters at this epoch, if known (empty: not known, e.g. mid-step)."""
        last = self.history[-1] if self.history else None
        return list(last.values) if last is not None and last.epoch == self.epoch else []

    # ---- state transfer -------------------------------------------------------------------
    @torch.no_grad()
    def snapshot(
        self, shard: int = 0, num_shards: int = 1, epoch: int | None = None
    ) -> tuple[dict, dict[str, torch.Tensor]]:
        """Parameters and optimizer state (CPU copies) with metadata: what a joining replica loads.

        With `num_shards` > 1, only part `shard` of the tensors (see `state_shards`), so that several
        donors, or one donor in several messages, each send a part. The first shard's request pins the
        state of this step (`epoch`), and the other shards of that step come from it even if this replica
        steps meanwhile (a big state takes longer to send than a step takes): each request copies only its
        own shard, and a change of the state while shards are still due (a step, a load) first copies
        those (`_keep_pinned`). One pin is kept, until all its shards were asked for or another request
        replaces it."""
        num_shards = max(num_shards, 1)
        live = self.state_tensors()
        pin = getattr(self, "_shared_snapshot", None)
        if (
            pin is None
            or pin["shards"] != num_shards
            or epoch is None
            or pin["metadata"]["epoch"] != epoch
            or (shard in pin["served"] and pin["changed"])  # sent already, and not kept since: the pin is over
        ):
            pin = {"shards": num_shards, "metadata": self.state_metadata(len(live)), "kept": {}, "served": set()}
            pin["changed"] = False  # the split is the pinned state's (a first step adds the optimizer's tensors)
            pin["parts"] = state_shards(live, num_shards) if num_shards > 1 else [set(live)]
        part = pin["parts"][shard]
        pin["served"].add(shard)
        tensors = {n: pin["kept"][n] if n in pin["kept"] else _copy(live[n]) for n in part}
        self._shared_snapshot = pin if num_shards > 1 and len(pin["served"]) < num_shards else None
        return pin["metadata"], tensors

    @torch.no_grad()
    def _keep_pinned(self) -> None:
        """Before the state changes (a step, a load): copy what a pinned snapshot still owes its joiners."""
        pin = getattr(self, "_shared_snapshot", None)
        if pin is None:
            return
        pin["changed"] = True
        live = self.state_tensors()
        for shard, names in enumerate(pin["parts"]):
            if shard not in pin["served"]:
                pin["kept"].update((n, _copy(live[n])) for n in names if n not in pin["kept"])

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Everything a state holds, by name: parameters, optimizer state, and in local mode anchor and momentum."""
        everything = {f"param/{n}": p for n, p in zip(self.param_names, self.params, strict=True)}
        for name, p in zip(self.param_names, self.params, strict=True):
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    everything[f"optim/{name}/{key}"] = value
        for name, a, m in zip(self.param_names, self.anchor, self.momentum, strict=False):
            everything[f"outer/anchor/{name}"] = a
            everything[f"outer/momentum/{name}"] = m
        return everything

    def state_metadata(self, tensor_count: int) -> dict:
        return {
            "part": self.name,
            "epoch": self.epoch,
            "samples_stepped": self.samples_stepped,
            "last_step_samples": self.history[-1].samples if self.history else 0,
            "spec": self.spec.fingerprint(),
            "tensor_count": tensor_count,
            # who made the recent steps, and what each step counted of each member's accumulator: a replica
            # that resyncs keeps the gradients no step of the donor counted, and drops the others
            "step_members": {str(f.epoch): f.members for f in list(self.history)[-STEP_MEMBERS:]},
            "step_coverage": {
                str(f.epoch): {pid: list(c) for pid, c in f.coverage.items()}
                for f in list(self.history)[-STEP_MEMBERS:]
            },
            "step_samples": {str(f.epoch): f.samples for f in list(self.history)[-STEP_MEMBERS:]},
            # the parameters' fingerprint at this epoch: a joiner checks what it loads against it
            "fingerprint": self.latest_fingerprint(),
        }

    def check_state(self, metadata: dict, tensors: dict[str, torch.Tensor], shapes: list[list[int]]) -> str:
        """Refuse (StateError) a donor's state that does not fit parameters of `shapes`; the key kind to load.

        Local mode: a replica starts from the anchor (the donor's inner steps since the outer step
        are the donor's own contribution to the next round, not ours to count again).
        """
        if metadata.get("part") != self.name or metadata.get("spec") != self.spec.fingerprint():
            raise StateError(f"state is for {metadata.get('part')} of spec {metadata.get('spec')}, not {self.name}")
        epoch = metadata.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise Poisoned(f"the state's epoch is {epoch!r}, not a step")
        stepped = metadata.get("samples_stepped", 0)
        if not isinstance(stepped, int) or isinstance(stepped, bool) or stepped < 0:
            # the schedule's position follows it (peer.model.optim.schedule_of): a negative count would give
            # a negative learning rate
            raise StateError(f"the state's samples_stepped is {stepped!r}, not a count of samples")
        source = "outer/anchor" if self.local else "param"
        for name, shape in zip(self.param_names, shapes, strict=True):
            for kind in (source, "outer/momentum") if self.local else (source,):
                t = tensors.get(f"{kind}/{name}")
                if t is None or list(t.shape) != list(shape):
                    raise StateError(f"state lacks {kind} {name} of shape {list(shape)}")
                if not all_finite(t):
                    raise Poisoned(f"{kind} {name} in the state is not finite")
            for slot in OPTIMIZER_SLOTS:
                t = tensors.get(f"optim/{name}/{slot}")
                want = [] if slot == "step" else list(shape)
                if t is not None and (t.numel() != 1 if slot == "step" else list(t.shape) != want):
                    raise StateError(f"optim/{name}/{slot} in the state has shape {list(t.shape)}, not {want}")
                if t is not None:
                    check_optimizer_slot(f"optim/{name}/{slot}", slot, t)
            if (m := tensors.get(f"optim/{name}/exp_avg")) is not None and (
                v := tensors.get(f"optim/{name}/exp_avg_sq")
            ) is not None:
                check_moments(f"optim/{name}", m, v, self.spec.training.betas)
        return source

    def check_fingerprint(self, metadata: dict, tensors: dict[str, torch.Tensor], source: str) -> None:
        """The whole parameters a state brings match the fingerprint its donor announced for them (StateError
        if not: shards mixed from replicas that went apart, or damaged). Kept for the history, so that an
        unsplit part's load does not sum its parameters twice (a split one sums its ranks' shards anew)."""
        values = state_fingerprint(tensors, self.param_names, source != "param")
        announced = [float(x) for x in metadata.get("fingerprint") or []]
        index = first_difference(announced, values)
        if index is not None:
            keys = fingerprint_keys(self.param_names, source != "param")
            name = keys[index] if index < len(keys) else "?"
            raise StateError(
                f"the state's {name} does not match the fingerprint its donor announced for step "
                f"{metadata.get('epoch')} (its shards disagree)"
            )
        self._checked_values = values if self.tp_degree == 1 else None

    @torch.no_grad()
    def check_reach(self, metadata: dict, tensors: dict[str, torch.Tensor], per_step: float, apart: int = 0) -> None:
        """A donor's parameters are no further from ours than the steps between could have moved them (StateError
        if not): one AdamW step moves an element by at most about `per_step` x lr, plus lr x weight decay of it.

        So a peer that claims a later step cannot hand a trained replica arbitrary weights. Checked for a
        replica with trained state of its own (step > 0), in gradient mode on an unsplit part. `apart`: this
        replica's steps since it last stepped in one group with the donor (or first saw it), each of which may
        have taken the two apart; plus one step of slack."""
        if self.local or self.tp_degree != 1 or not self.initialized or self.epoch <= 0:
            return
        # both sides may have moved since they last stepped together: `apart` steps each
        steps, t = int(metadata["epoch"]) - self.epoch + 1 + 2 * max(apart, 0), self.spec.training
        for name, p in zip(self.param_names, self.params, strict=True):
            bound = max(steps, 1) * t.lr * (per_step + t.weight_decay * float(p.abs().max()))
            moved = max(
                (
                    float((new.to(old.device) - old).abs().max())
                    for new, old in zip(
                        tensors[f"param/{name}"].reshape(-1).split(1 << 20), p.reshape(-1).split(1 << 20), strict=True
                    )
                ),
                default=0.0,
            )
            if moved > bound:
                raise OutOfReach(
                    f"the state of step {metadata['epoch']} moves {name} by {moved:.3g} from this replica's step "
                    f"{self.epoch}, more than {steps} steps could ({bound:.3g}, server.max_update_per_step)"
                )

    @torch.no_grad()
    def load_state(self, metadata: dict, tensors: dict[str, torch.Tensor], me: str = "") -> None:
        """Take a donor's state (keeping the accumulator); `me` is this replica's peer id."""
        source = self.check_state(metadata, tensors, [list(p.shape) for p in self.params])
        try:  # the metadata read before anything changes: a malformed part of it must not leave a half-loaded state
            steps = inherited_steps(metadata)
            last_samples = int(metadata.get("last_step_samples", 0))
        except (TypeError, ValueError, AttributeError, IndexError) as e:
            raise Poisoned(f"the state's step records are malformed ({type(e).__name__}: {e})") from None
        self._keep_pinned()  # shards of the state before, still owed to a joiner
        if self.tp_degree == 1:  # a split part's ranks load shards: checked whole on rank 0 (peer.model.tp_runtime)
            self.check_fingerprint(metadata, tensors, source)
        for i, (name, p) in enumerate(zip(self.param_names, self.params, strict=True)):
            take(p, tensors[f"{source}/{name}"])
            if self.local:
                self.anchor[i].copy_(p)
                self.momentum[i].copy_(tensors[f"outer/momentum/{name}"])
            state = {}
            for key in ("step", "exp_avg", "exp_avg_sq"):
                t = tensors.get(f"optim/{name}/{key}")
                if t is not None:
                    state[key] = t.to(p.device) if whole(t) else t.to(p.device, copy=True)
            if state:
                self.optimizer.state[p] = state
        self.initialized = True
        if self.restored and self.restored[0].epoch < int(metadata["epoch"]):
            # the donor's step after a round that failed here may have had us in its group: the round
            # succeeded on its side, with the part of our accumulator it covered; that part is accounted
            self._drop_what_the_donor_counted(steps.get(self.restored[0].epoch + 1), me)
            self.restored = []  # any other piece waits for the next step like the rest of the accumulator
        self.epoch = int(metadata["epoch"])
        self.samples_stepped = int(metadata.get("samples_stepped", 0))
        self.inner_steps = self.inner_samples = 0  # local mode: at the anchor, no inner step of ours on it yet
        self._taken = None
        if self.epoch > 0:  # the parameters after this step are now the donor's
            self._inherit_history(steps, last_samples)
        self._checked_values = None
        self._stash = None
        self.version += 1
        self._after_load()


@torch.no_grad()
def state_fingerprint(tensors: dict[str, torch.Tensor], names: list[str], local: bool) -> list[float]:
    """A state's fingerprint (`tensor_fingerprint`s): each parameter's, in `names` order; then, per parameter, its
    AdamW state's (`OPTIMIZER_SLOTS`, [0, 0] where the optimizer holds none yet). In local mode the anchor's, then
    the outer momentum's (each replica's inner optimizer is its own). Replicas that step together apply the same
    averaged gradients, so they hold the same optimizer state too: a donor cannot pass the honest weights with
    moments or step counts of its choosing (a huge `exp_avg_sq` stalls learning) where a second replica is asked.
    Read back once per device, not once per tensor (each read waits for the device)."""
    keys = fingerprint_keys(names, local)
    pairs = [tensor_fingerprint(tensors[key]) for key in keys[: len(names)]]
    pairs += [None if (t := tensors.get(key)) is None else tensor_fingerprint(t) for key in keys[len(names) :]]
    return read_pairs(pairs)


def read_pairs(pairs: list[torch.Tensor | None]) -> list[float]:
    """`tensor_fingerprint` pairs as floats, one after the other ([0, 0] for None), read in one transfer per device."""
    out: list[list[float]] = [[0.0, 0.0]] * len(pairs)
    by_device: dict[torch.device, list[int]] = {}
    for i, pair in enumerate(pairs):
        if pair is not None:
            by_device.setdefault(pair.device, []).append(i)
    for indices in by_device.values():
        for i, values in zip(indices, torch.stack([pairs[i] for i in indices]).tolist(), strict=True):
            out[i] = values
    return [x for pair in out for x in pair]


def fingerprint_keys(names: list[str], local: bool) -> list[str]:
    """The state tensors a `state_fingerprint` covers, in its order (one [sum, sum of squares] pair each)."""
    if local:
        return [*(f"outer/anchor/{n}" for n in names), *(f"outer/momentum/{n}" for n in names)]
    return [*(f"param/{n}" for n in names), *(f"optim/{n}/{slot}" for n in names for slot in OPTIMIZER_SLOTS)]


@torch.no_grad()
def tensor_fingerprint(t: torch.Tensor, block: int = 1 << 20) -> torch.Tensor:
    """[sum, sum of squares] of `t` in float64, on its device (not read back), `block` elements at a time, reduced
    by torch in float64 (no squared temporary: half the time of casting each block and squaring it here)."""
    total = squares = torch.zeros((), dtype=torch.float64, device=t.device)
    for part in t.detach().reshape(-1).split(block):
        if not part.is_floating_point():
            part = part.double()  # vector_norm takes floating tensors only
        total = total + torch.sum(part, dtype=torch.float64)
        squares = squares + torch.linalg.vector_norm(part, dtype=torch.float64) ** 2
    return torch.stack([total, squares])


def whole(t: torch.Tensor) -> bool:
    """Whether `t` is all of its memory (not a slice of a buffer it shares with other tensors)."""
    return t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def take(p: torch.Tensor, t: torch.Tensor) -> None:
    """Load `t` into the parameter `p`: its memory becomes the parameter's when it fits (a tensor decoded
    from the wire is ours), so a load holds one copy of the state, not two; else a copy."""
    if t.dtype == p.dtype and t.device == p.device and whole(t):
        p.data = t
    else:
        p.copy_(t)


def inherited_steps(metadata: dict) -> dict[int, Fingerprint]:
    """The donor's recent steps from a state's metadata: who made each and what it counted (no values)."""
    members = metadata.get("step_members") or {}
    coverage = metadata.get("step_coverage") or {}
    samples = metadata.get("step_samples") or {}
    return {
        int(epoch): Fingerprint(
            int(epoch),
            int(samples.get(epoch, 0)),
            [],
            list(members.get(epoch, [])),
            {pid: (int(c[0]), int(c[1])) for pid, c in coverage.get(epoch, {}).items()},
        )
        for epoch in sorted({*members, *coverage}, key=int)
    }


def check_optimizer_slot(label: str, slot: str, t: torch.Tensor) -> None:
    """Poisoned if AdamW state `slot` (exp_avg, exp_avg_sq, step) is not one an AdamW step leaves: finite, a second
    moment never below 0 (its square root divides the update), a step count of at least 1 (bias correction
    divides by 1 - beta^step)."""
    if not all_finite(t):
        raise Poisoned(f"{label} in the state is not finite")
    if slot == "exp_avg_sq" and t.numel() and float(t.min()) < 0:
        raise Poisoned(f"{label} in the state is negative ({float(t.min()):.3g}): it is a mean of squares")
    if slot == "step" and float(t) < 1:
        raise Poisoned(f"{label} in the state is {float(t):g}: an optimizer state counts at least one step")


def moment_bound(betas) -> float:
    """The most |exp_avg| can be per unit of sqrt(exp_avg_sq) after any gradients (0: no bound, beta1^2 >= beta2).

    m = (1 - b1) sum b1^k g_k and v = (1 - b2) sum b2^k g_k^2; by Cauchy-Schwarz, m^2 <= (1 - b1)^2 / ((1 - b2)
    (1 - b1^2 / b2)) v. With the default betas (0.9, 0.95), 1.17: a state whose first moments exceed it would
    move the weights further in one step than any gradients could."""
    b1, b2 = float(betas[0]), float(betas[1])
    if b2 <= 0 or b1 * b1 >= b2:
        return 0.0
    return (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))


def check_moments(label: str, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, betas) -> None:
    """Poisoned if a parameter's first moments are larger than its second moments allow (moment_bound, with 5 %
    of slack for rounding, and 1e-12 where the second moments underflowed): no gradients leave such a state."""
    bound = moment_bound(betas)
    if not bound or exp_avg.shape != exp_avg_sq.shape or not exp_avg.numel():
        return
    excess = (exp_avg.abs() - (1.05 * bound * exp_avg_sq.clamp(min=0).sqrt() + 1e-12)).max()
    if float(excess) > 0:
        raise Poisoned(f"{label}/exp_avg in the state is larger than its exp_avg_sq allows (by {float(excess):.3g})")


def shard_request_error(shard: int, num_shards: int, bound: int) -> str:
    """Why a state request for part `shard` of `num_shards` is refused ("" if it is not): num_shards sizes the
    split's work, so it has a bound (server.max_state_shards)."""
    if num_shards > bound:
        return f"num_shards: {num_shards}, more than server.max_state_shards ({bound})"
    if shard >= max(num_shards, 1):
        return f"shard {shard} does not exist: num_shards is {max(num_shards, 1)}"
    return ""


def state_shards(tensors: dict[str, torch.Tensor], num_shards: int) -> list[set[str]]:
    """Split tensor names into `num_shards` parts of similar bytes; every replica computes the same split."""
    return shards_by_bytes({n: t.numel() * t.element_size() for n, t in tensors.items()}, num_shards)


def shards_by_bytes(sizes: dict[str, int], num_shards: int) -> list[set[str]]:
    """Split names into `num_shards` parts of similar total bytes, the largest first; deterministic."""
    parts: list[set[str]] = [set() for _ in range(num_shards)]
    totals = [0] * num_shards
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        lightest = min(range(num_shards), key=lambda i: (totals[i], i))
        parts[lightest].add(name)
        totals[lightest] += size
    return parts


def _same_step(own: Fingerprint | None, donor: Fingerprint) -> Fingerprint:
    """Our record of a step the donor made too (with real values), if it was the same step: one group's.
    A step we made apart (both alone, say) is not the one whose state we now hold: the donor's says."""
    return own if own is not None and sorted(own.members) == sorted(donor.members) else donor


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of a state tensor (what a joiner is sent)."""
    return t.detach().cpu().clone().reshape(t.shape)
