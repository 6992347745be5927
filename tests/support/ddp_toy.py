"""A 484-element toy model trained on gloo ranks by the engine's DDP and optimizer, and the same training in one
process by torch's AdamW on the whole global batch: what the DDP, distributed-optimizer and expert-buffer tests
compare (to 1e-5 relative over 5 steps), with every collective logged against the phase of the step."""
from __future__ import annotations

import torch

from common.config import TrainConfig
from engine.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from engine.optimizer import get_megatron_optimizer
from engine.pipeline_parallel.schedules import ScheduleConfig, forward_backward_no_pipelining
from tests.support.recording_probes import PhaseLog

STEPS, MICROBATCHES = 5, 2
TRAIN = dict(lr=0.01, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, clip_grad=0.05)  # clipping is active
BUCKET_SIZE = 100  # elements: several buckets in the 484-element model below


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


def build_dense(ps) -> torch.nn.Module:
    return make_model()


def microbatch(step: int, dp_rank: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * dp_rank + mb)
    return torch.randn(3, 8, generator=g), torch.randn(3, 4, generator=g)


def reference_adamw(dp_size: int, train: TrainConfig) -> dict:
    model = make_model()
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim == 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": train.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for r in range(dp_size):
            for mb in range(MICROBATCHES):
                x, y = microbatch(step, r, mb)
                loss = torch.nn.functional.mse_loss(model(x), y) / (dp_size * MICROBATCHES)
                loss.backward()
                total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), train.clip_grad).item())
        opt.step()
        losses.append(total)
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def train_ranks(rank: int, world_size: int, configs: list[dict], tp: int = 1, build=build_dense) -> list[dict]:
    """Each config: TrainConfig overrides (distributed optimizer, overlaps, bf16); returns per config the global
    losses, grad norms, final params, the collective log, and the optimizer's inventory before and after its first
    step."""
    from engine.parallel_state import ParallelState

    ps = ParallelState.initialize(tp=tp)
    return [_train_one(ps, dict(cfg), build) for cfg in configs]


def _train_one(ps, cfg: dict, build) -> dict:
    train = TrainConfig(ddp_bucket_size=BUCKET_SIZE, **cfg, **TRAIN)
    dtype = torch.bfloat16 if train.bf16 else torch.float32
    probes = PhaseLog()
    model = build(ps).to(dtype)
    for name, module in model.named_children():
        module.marker = name
        module.register_forward_pre_hook(probes.forward_marker)
    ddp_config = DistributedDataParallelConfig.from_train_config(train, ps.dp_size)
    ddp = DistributedDataParallel(ddp_config, model, ps, probes)
    optimizer = get_megatron_optimizer(train, [ddp], ps)
    inventories = [optimizer.inventory()]

    loss_total = torch.zeros(())

    def forward_step(data_iterator, model):
        mb, (x, y) = next(data_iterator)
        probes.phase = ("microbatch", mb)

        def loss_func(out):
            loss = torch.nn.functional.mse_loss(out.float(), y)
            loss_total.add_(loss.detach())
            return loss, {"lm loss": loss.detach()}
        return model(x.to(dtype)), loss_func

    def finalize(chunks):
        probes.phase = ("finalize",)
        ddp.start_grad_sync()  # as a schedule's grad_sync_func may: must not issue a second reduction
        finalize_model_grads(chunks, ps)

    schedule = ScheduleConfig(no_sync_func=ddp.no_sync, finalize_model_grads_func=finalize)
    losses, norms, phases = [], [], []
    for step in range(STEPS):
        probes.phase = ("zero_grad",)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        data = iter([(mb, microbatch(step, ps.dp_rank, mb)) for mb in range(MICROBATCHES)])
        loss_total.zero_()
        forward_backward_no_pipelining(forward_step_func=forward_step, data_iterator=data, model=ddp,
                                       num_microbatches=MICROBATCHES, config=schedule)
        if ps.groups["dp_cp"].size() > 1:  # a group of one has no communicator: its sum is the rank's own
            torch.distributed.all_reduce(loss_total, group=ps.groups["dp_cp"])
        probes.phase = ("step",)
        _, norm = optimizer.step()
        if step == 0:
            inventories.append(optimizer.inventory())
        losses.append(loss_total.item() / (ps.dp_size * MICROBATCHES))
        norms.append(norm)
        phases.append(len(probes.events))
    probes.phase = ("final",)
    ddp.start_param_sync(force_sync=True)
    return {"losses": losses, "norms": norms, "events": probes.events, "step_ends": phases,
            "groups": len(ddp.bucket_groups), "inventories": inventories, "ddp_inventory": ddp.inventory(),
            "params": {n: p.detach().float().clone() for n, p in model.named_parameters()},
            "ranks": (ps.tp_rank, ps.dp_rank)}


def assert_matches_reference(result: dict, reference: dict, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(reference[key]), rtol=rtol, atol=0,
                                   msg=key)
    for name, value in reference["params"].items():
        torch.testing.assert_close(result["params"][name], value, rtol=rtol, atol=atol, msg=name)
