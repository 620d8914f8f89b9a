import torch

import autotune


class Frag(torch.nn.Module):
    """Many differently sized large temporaries, every other one kept: the caching allocator fragments."""
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(16))

    def forward(self, x):
        kept = []
        for i in range(12):
            t = x.new_empty(x.shape[0] * (65536 * (3 + (i * 7) % 11)))
            if i % 2 == 0:
                kept.append(t)
            del t
        big = x.new_empty(x.shape[0] * 65536 * 20)
        return (x * self.w).sum() + sum(k.sum() for k in kept) * 0 + big.sum() * 0

def build():
    return autotune.Workload(name="frag", model=Frag,
        batch=lambda n, g: torch.randn(n, 16, generator=g),
        loss=lambda m, b: m(b), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
