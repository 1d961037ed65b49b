import pytest
import torch

from fedtailor.models import FlatLayout, build_model, get_flat, num_parameters, set_flat


@pytest.mark.parametrize(("shape", "expected"), [((1, 28, 28), 85_822), ((3, 32, 32), 121_182)])
def test_lenet_has_the_papers_parameter_count(shape, expected):
    model = build_model("lenet", input_shape=shape, num_classes=10)
    assert num_parameters(model) == expected
    assert model(torch.zeros(2, *shape)).shape == (2, 10)


def test_public_seed_fixes_the_initialisation():
    a = get_flat(build_model("lenet", input_shape=(1, 28, 28), num_classes=10, seed=41))
    b = get_flat(build_model("lenet", input_shape=(1, 28, 28), num_classes=10, seed=41))
    c = get_flat(build_model("lenet", input_shape=(1, 28, 28), num_classes=10, seed=42))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_flat_round_trip_and_layout_order():
    model = build_model("lenet", input_shape=(1, 28, 28), num_classes=10, seed=0)
    layout = FlatLayout.of(model)
    vec = torch.randn(layout.size)
    set_flat(model, vec)
    assert torch.equal(get_flat(model), vec)
    parts = layout.unflatten(vec)
    assert list(parts) == [n for n, _ in model.named_parameters()]
    assert torch.equal(layout.flatten(parts), vec)
    batched = layout.unflatten(torch.stack([vec, 2 * vec]))
    assert torch.equal(batched["fc3.bias"][1], 2 * parts["fc3.bias"])


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match="lenet"):
        build_model("resnet", input_shape=(1, 28, 28), num_classes=10)


def test_pooling_before_the_relu_is_the_papers_network_bit_for_bit():
    """LeNet pools before each ReLU (a quarter of the ReLU work); the paper's order, ReLU then pooling, gives the
    same logits and the same gradients exactly (max and ReLU commute; both route a gradient to the same entry)."""
    from fedtailor.models.lenet import LeNet

    class ReluFirst(LeNet):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.max_pool2d(torch.relu(self.conv1((x - 0.5) / 0.5)), 2)
            x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
            x = torch.relu(self.fc1(x.flatten(1)))
            return self.fc3(torch.relu(self.fc2(x)))

    torch.manual_seed(0)
    ours = LeNet()
    theirs = ReluFirst()
    theirs.load_state_dict(ours.state_dict())
    x, y = torch.rand(64, 1, 28, 28), torch.randint(0, 10, (64,))
    out = [m(x) for m in (ours, theirs)]
    assert torch.equal(out[0], out[1])
    grads = [
        torch.autograd.grad(torch.nn.functional.cross_entropy(o, y), list(m.parameters()))
        for o, m in zip(out, (ours, theirs))
    ]
    assert all(torch.equal(a, b) for a, b in zip(*grads))
