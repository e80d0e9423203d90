"""The kit's :class:`~triton_reshard.integrations.engine.ModuleShadow` (issue 45's commit by swap), without an
engine: new weights built on the shadow leave the live tree untouched, bit for bit, until ``swap``; ``swap`` puts
them in the live tensors (the same objects), the attributes the build set or removed likewise (methods bound to
the shadow rebound to the live module), and a shadow whose tensor cannot be swapped in place is refused by
``check`` naming it. Runs in the main test environment (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from triton_reshard.integrations.engine import ModuleShadow, private_tensor


class Lin(torch.nn.Module):
    def __init__(self, n: int, k: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.randn(n), requires_grad=False)
        self.register_buffer("scale", torch.ones(n))
        self.weight.weight_loader = self.load  # a loader bound to its layer, as vLLM's are
        self.stale = "old"
        self.packed = None

    def load(self, param, w):
        param.data.copy_(w)

    def forward(self, x):
        return x @ self.packed.t() + self.bias if self.packed is not None else x @ self.weight.t() + self.bias


def _tree():
    torch.manual_seed(0)
    shared = Lin(5, 3)
    root = torch.nn.ModuleDict({"a": Lin(4, 3), "b": shared, "c": torch.nn.Sequential(shared, Lin(3, 5))})
    return root


def _state(root):
    return {n: t.clone() for n, t in root.state_dict().items()}


def test_build_on_the_shadow_then_swap():
    root = _tree()
    before, ids = _state(root), {n: id(t) for n, t in root.named_parameters()}
    sh = ModuleShadow(root)
    assert sh.root["b"] is sh.root["c"][0]  # a shared module stays shared
    new = {}
    for name, m, s in sh.pairs:
        if not isinstance(m, Lin):
            continue
        for pn in ("weight", "bias"):
            s._parameters[pn] = private_tensor(m._parameters[pn], (m,), s)
        assert s.weight.weight_loader.__self__ is s and m.weight.weight_loader.__self__ is m
        w = torch.randn_like(m.weight)
        s.weight.weight_loader(s.weight, w)  # the loader writes the shadow's tensor
        s.bias.data.add_(1.0)
        new[name] = (w.clone(), s.bias.detach().clone())
        s.packed = w * 2  # what a re-pack sets (here: a tensor the forward reads instead of the weight)
        s.fwd = s.forward  # a method bound to the shadow, set by the build
        del s.stale
        sh.built.append((name, m, s))
    sh.check()
    after_build = _state(root)
    assert all(torch.equal(before[k], after_build[k]) for k in before), "the build wrote into the live tree"
    assert all(m.packed is None and m.stale == "old" for _, m, _ in sh.built)
    sh.swap()
    for name, m, _ in [(n, m, s) for n, m, s in sh.pairs if isinstance(m, Lin)]:
        torch.testing.assert_close(m.weight, new[name][0], rtol=0, atol=0)
        torch.testing.assert_close(m.bias, new[name][1], rtol=0, atol=0)
        assert m.packed is not None and not hasattr(m, "stale") and m.fwd.__self__ is m
        x = torch.randn(2, m.weight.shape[1])
        torch.testing.assert_close(m(x), x @ (new[name][0] * 2).t() + new[name][1], rtol=0, atol=0)
    assert {n: id(t) for n, t in root.named_parameters()} == ids  # the live objects stay (whoever holds them)


def test_check_refuses_a_tensor_it_cannot_swap_in_place():
    root = _tree()
    sh = ModuleShadow(root)
    name, m, s = next((n, m, s) for n, m, s in sh.pairs if n == "a")
    s._parameters["bias"] = torch.nn.Parameter(torch.zeros(7), requires_grad=False)
    sh.built.append((name, m, s))
    before = _state(root)
    with pytest.raises(ValueError, match=r"a\.bias: the rebuilt parameter is \(\(7,\), torch\.float32\)"):
        sh.check()
    assert all(torch.equal(before[k], v) for k, v in _state(root).items())
