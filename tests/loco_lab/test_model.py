"""The byte-level Llama-style model: shapes, gradients, causality, rotary embeddings."""
import pytest
import torch

from loco_lab.model import SIZES, VOCAB, ByteLlama, ModelConfig, apply_rotary, count_parameters, rotary_tables

TINY = ModelConfig(layers=2, dim=32, heads=2, seq_len=16)


def test_forward_backward_shapes():
    torch.manual_seed(0)
    model = ByteLlama(TINY)
    x = torch.randint(0, VOCAB, (3, 16))
    logits = model(x)
    assert logits.shape == (3, 16, VOCAB)
    loss = model(x, x)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5  # near uniform at initialisation
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
        assert torch.isfinite(p.grad).all(), name


def test_shorter_sequences_and_too_long():
    model = ByteLlama(TINY)
    assert model(torch.randint(0, VOCAB, (2, 5))).shape == (2, 5, VOCAB)
    with pytest.raises(ValueError, match="longer than"):
        model(torch.randint(0, VOCAB, (1, 17)))


def test_causal():
    torch.manual_seed(0)
    model = ByteLlama(TINY).eval()
    x = torch.randint(0, VOCAB, (1, 16))
    y = x.clone()
    y[0, 10] = (y[0, 10] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-5)
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_rotary_preserves_norm_and_relative_positions():
    cos, sin = rotary_tables(8, 4, 10000.0)
    q = torch.randn(1, 1, 8, 4)
    rq = apply_rotary(q, cos, sin)
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    # the same vector at positions (i, j) and (i+1, j+1) has the same dot product
    v = torch.randn(4).expand(1, 1, 8, 4)
    rv = apply_rotary(v, cos, sin)[0, 0]
    assert torch.allclose(rv[2] @ rv[5], rv[3] @ rv[6], atol=1e-5)


def test_deterministic_init_and_sizes():
    torch.manual_seed(5)
    a = ByteLlama(TINY)
    torch.manual_seed(5)
    b = ByteLlama(TINY)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert count_parameters(ByteLlama(SIZES["tiny"])) < count_parameters(ByteLlama(SIZES["small"]))
    for cfg in SIZES.values():
        assert cfg.dim % cfg.heads == 0 and (cfg.dim // cfg.heads) % 2 == 0


def test_the_larger_sizes_have_the_documented_parameter_counts():
    with torch.device("meta"):  # no memory: only the shapes count
        counts = {name: count_parameters(ByteLlama(SIZES[name])) for name in ("medium", "30m", "125m")}
    assert counts == {"medium": 10_818_432, "30m": 32_155_200, "125m": 116_430_720}


def test_mean_loss_weights_each_batch_by_its_size():
    from loco_lab.model import mean_loss
    torch.manual_seed(0)
    model = ByteLlama(TINY)
    batches = [(torch.randint(0, VOCAB, (n, 16)), torch.randint(0, VOCAB, (n, 16))) for n in (1, 3)]
    with torch.no_grad():
        expected = (float(model(*batches[0])) + 3 * float(model(*batches[1]))) / 4
        assert mean_loss(model, batches) == pytest.approx(expected, rel=1e-12)
