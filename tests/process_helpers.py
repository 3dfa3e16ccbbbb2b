"""Helpers for tests that start real processes."""


def process_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between it and the read
        return False


def hf_reference_losses(spec: str, seq: int, global_batch_size: int, steps: int, lr: float, seed: int) -> list[float]:
    """Single-process training of a Hugging Face model as the executor trains it (the same
    seed, batches, AdamW, clipping and schedule), one loss per step: the parity reference."""
    import torch

    from meshplan.executor.data import global_batch, make_source
    from meshplan.executor.runtime import Hyperparameters, lr_at
    from meshplan.planner.models.registry import build_model
    from meshplan.planner.models.transformer import lm_loss

    torch.manual_seed(seed)
    built = build_model(spec, seq, device="cpu")
    model = built.module
    hp = Hyperparameters(lr=lr)
    optimizer = torch.optim.AdamW(model.parameters(), lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                                  weight_decay=hp.weight_decay)
    source = make_source("synthetic", built.info.vocab, seq, seed)
    losses = []
    for step in range(steps):
        inputs, targets = global_batch(source, step, global_batch_size)
        optimizer.zero_grad()
        loss = lm_loss(built.forward_fn(model, (inputs,)), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hp.max_grad_norm)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, hp)
        optimizer.step()
        losses.append(loss.item())
    return losses
