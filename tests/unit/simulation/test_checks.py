"""Bad fields of a TrainingSetup or SimulationSpec: each is one clear TypeError/ValueError naming the field, raised
when the spec is built, before anything trains (model_fn and data_fn never called); a data_fn that runs out names the
step."""
import pytest
import torch

from deepspeed_loco.config import LocoConfigError
from deepspeed_loco.simulation import SimulationSpec, TrainingSetup, simulate

WORLD = 4  # nodes=2 x local=2, TrainingSetup's defaults
RUN_FIELDS = ("arms", "steps", "seed")


class Counted:
    """A tiny model and data whose factories count their calls: 0 calls means nothing trained."""

    def __init__(self, batches=None):
        self.models = self.datas = 0
        self.batches = batches

    def model_fn(self):
        self.models += 1
        return torch.nn.Linear(4, 1)

    def data_fn(self):
        self.datas += 1
        if self.batches is not None:
            return iter(self.batches)
        return iter(lambda: (torch.ones(WORLD, 4), torch.zeros(WORLD, 1)), None)  # endless

    @staticmethod
    def loss_fn(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)


@pytest.fixture
def counted():
    return Counted()


def _simulate(counted, **overrides):
    fields = {**dict(model_fn=counted.model_fn, data_fn=counted.data_fn, arms=["full", "loco4"], steps=1,
                     loss_fn=Counted.loss_fn, loco={"group_size": 32}), **overrides}
    run = {name: fields.pop(name) for name in RUN_FIELDS if name in fields}
    return simulate(SimulationSpec(TrainingSetup(**fields), **run))


BAD = [  # (arguments, error, message)
    (dict(nodes=0), ValueError, r"TrainingSetup: nodes = 0 is invalid: it must be an integer >= 1"),
    (dict(local=-1), ValueError, r"TrainingSetup: local = -1 is invalid: it must be an integer >= 1"),
    (dict(nodes=2.0), TypeError, r"nodes = 2.0 is invalid: it must be an integer"),
    (dict(steps=0), ValueError, r"steps = 0 is invalid: it must be an integer >= 1"),
    (dict(steps=1.5), TypeError, r"steps = 1.5 is invalid: it must be an integer >= 1"),
    (dict(steps=True), TypeError, r"steps = True is invalid"),
    (dict(seed=-3), ValueError, r"seed = -3 is invalid: it must be an integer >= 0"),
    (dict(eval_every=-1, eval_fn=lambda m: 0.0), ValueError, r"eval_every = -1 is invalid: it must be an integer >= 0"),
    (dict(eval_every=5), ValueError, r"eval_every = 5 is invalid without an eval_fn"),
    (dict(grad_clip=0), ValueError, r"grad_clip = 0 is invalid: it must be a number > 0 .* or None"),
    (dict(grad_clip=-1.0), ValueError, r"grad_clip = -1.0 is invalid"),
    (dict(grad_clip=float("nan")), ValueError, r"grad_clip = nan is invalid"),
    (dict(grad_clip="1"), TypeError, r"grad_clip = '1' is invalid"),
    (dict(device="cdua"), ValueError, r"device = 'cdua' is invalid: it must be a device string such as 'cpu'"),
    (dict(device=0), TypeError, r"device = 0 is invalid: it must be a device string"),
    (dict(grad_mode="batched"), ValueError, r"grad_mode = 'batched' is invalid: it must be one of \('vmap', 'loop'\)"),
    (dict(autocast_dtype=torch.float32), ValueError, r"autocast_dtype = torch.float32 is invalid: it must be one of"),
    (dict(stream_nodes=1), TypeError, r"stream_nodes = 1 is invalid: it must be True or False"),
    (dict(arms=[]), ValueError, r"SimulationSpec: arms: no arm given; arms are 'full'"),
    (dict(arms="full"), TypeError, r"arms = 'full' is invalid: it must be a list of arm names"),
    (dict(arms=["loco4", "full", "loco4"]), ValueError, r"SimulationSpec: arms: arm\(s\) loco4 given more than once"),
    (dict(arms=["loco5"]), ValueError, r"SimulationSpec: arms: arm 'loco5' is invalid: .*W in 2, 3, 4, 8"),
    (dict(arms=[4]), TypeError, r"SimulationSpec: arms: 4 is invalid: an arm is a name such as 'loco4' or an Arm"),
    (dict(model_fn=None), TypeError, r"model_fn = None is invalid: it must be a callable"),
    (dict(eval_fn=3), TypeError, r"eval_fn = 3 is invalid: it must be a callable or None"),
    (dict(optimizer_fn=None), TypeError, r"optimizer_fn = None is invalid: it must be a callable"),
    (dict(loco=[("group_size", 32)]), TypeError, r"loco = \[.*\] is invalid: it must be a dict of zeropp_loco_param"),
    (dict(loco={"local_world_size": 3}), ValueError,
     r"loco\['local_world_size'\] = 3 is invalid: the ranks per node are the setup's local field"),
    (dict(loco={"inter_node_bits": 2}), ValueError, r"loco keys \['inter_node_bits'\] are invalid: each arm's name"),
]


@pytest.mark.parametrize("overrides, error, message", BAD, ids=[repr(b[0])[:40] for b in BAD])
def test_bad_argument_is_one_clear_error_before_training(counted, overrides, error, message):
    with pytest.raises(error, match=message):
        _simulate(counted, **overrides)
    assert (counted.models, counted.datas) == (0, 0)


@pytest.mark.parametrize("arms", [["full", "loco4"], ["full"], ["plain2"]])
@pytest.mark.parametrize("loco, message", [
    ({"err_beta": 2.0}, r"zeropp_loco_param.err_beta = 2.0 is invalid: it must be a float with 0 <= err_beta < 1"),
    ({"group_size": 0}, r"zeropp_loco_param.group_size = 0 is invalid: it must be a power of two from 32 to 4096"),
    ({"group_sise": 64}, r"zeropp_loco_param: unknown key\(s\) \['group_sise'\]; valid keys are"),
])
def test_bad_loco_block_is_rejected_up_front_whatever_the_arms(counted, arms, loco, message):
    """The full arm used to train first (or, alone, never see the block at all)."""
    with pytest.raises(LocoConfigError, match=r"TrainingSetup: loco = \{.*\} is invalid: " + message):
        _simulate(counted, arms=arms, loco=loco)
    assert (counted.models, counted.datas) == (0, 0)


def test_a_short_data_fn_names_the_step_it_ran_out_at():
    short = Counted(batches=[(torch.ones(WORLD, 4), torch.zeros(WORLD, 1))] * 2)
    with pytest.raises(ValueError, match=r"data_fn\(\) ran out of batches at step 3 of steps = 5: it must yield at "
                                         r"least 5 batches"):
        _simulate(short, arms=["full"], steps=5)


@pytest.mark.parametrize("batch, error, message", [
    ([torch.ones(WORLD, 4), torch.zeros(WORLD, 1)], TypeError,
     r"a batch from data_fn is a list: it must be a tensor or a tuple of tensors"),
    ((torch.ones(WORLD, 4), torch.zeros(2 * WORLD, 1)), ValueError,
     r"a global batch of 4/8 does not split into 4 equal micro-batches"),
])
def test_bad_batches_are_clear_errors(batch, error, message):
    with pytest.raises(error, match=message):
        _simulate(Counted(batches=[batch]), arms=["full"])


def test_what_model_fn_and_data_fn_return_is_checked(counted):
    counted.model_fn = lambda: "model"
    with pytest.raises(TypeError, match=r"model_fn\(\) returned str: it must return a torch.nn.Module"):
        _simulate(counted, arms=["full"])
    counted = Counted()
    counted.data_fn = lambda: 42
    with pytest.raises(TypeError, match=r"data_fn\(\) returned int: it must return an iterable of batches"):
        _simulate(counted, arms=["full"])


def test_good_arguments_still_train(counted):
    full, loco = _simulate(counted, steps=2, grad_clip=1.0, eval_fn=lambda m: 1.0, eval_every=1, seed=0)
    assert len(full.train_losses) == len(loco.train_losses) == 2 and full.validation == [(1, 1.0), (2, 1.0)]
    assert full.bytes_per_step == full.full_precision_bytes_per_step == 3 / 4 * 5 * 4  # the full arm: ratio 1.0
