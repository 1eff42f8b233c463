"""Import-path plug-ins (no MPI): every failure is one line naming the option and what is missing."""

import pytest

from hpcps.options.config import make_config
from hpcps.errors import UserError
from hpcps.plugins import call_with_accepted, is_plugin, load_plugin
from hpcps.training.workload import resolve_loss, resolve_model, workload_from_config


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("import torch\nSCALE = 3\n"
                    "def net(in_shape, n_classes):\n    return torch.nn.Linear(in_shape[-1], n_classes)\n"
                    "class Holder:\n    def build():\n        return torch.nn.Linear(2, 2)\n")
    return path


def test_names_and_plugins_are_told_apart():
    assert is_plugin("pkg.mod:name") and is_plugin("dir/file.py:factory") and is_plugin("m:A.b")
    assert not is_plugin("mlp") and not is_plugin("digits") and not is_plugin("data.h5") and not is_plugin(":x")


def test_a_file_plugin_loads_once_and_reaches_nested_attributes(plugin_file):
    net = load_plugin(f"{plugin_file}:net", "--model")
    assert load_plugin(f"{plugin_file}:net", "--model") is net
    assert load_plugin(f"{plugin_file}:Holder.build", "--model")().in_features == 2
    assert load_plugin("hpcps.training.models:mlp", "--model").__name__ == "mlp"


@pytest.mark.parametrize("spec,option,message", [
    ("nosuch/file.py:net", "--model", "--model nosuch/file.py: no such file"),
    ("{file}:missing", "--model", "has no attribute 'missing'"),
    ("hpcps_nosuch_pkg.mod:f", "--dataset", "--dataset hpcps_nosuch_pkg.mod: no module named 'hpcps_nosuch_pkg'"),
    ("hpcps.training.models:nothing", "--loss", "--loss hpcps.training.models:nothing: hpcps.training.models has no attribute 'nothing'"),
])
def test_each_plugin_error_is_one_line_naming_the_option(plugin_file, spec, option, message):
    with pytest.raises(UserError) as err:
        load_plugin(spec.format(file=plugin_file), option)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_plugin_file_that_fails_to_run_is_named(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(UserError, match=r"--model .*bad.py: running it failed: RuntimeError: boom"):
        load_plugin(f"{bad}:net", "--model")


def test_a_plugin_that_is_not_callable_is_refused(plugin_file):
    with pytest.raises(UserError, match=r"--model .*:SCALE: a int is not callable \(a model factory\)"):
        resolve_model(f"{plugin_file}:SCALE")
    with pytest.raises(UserError, match=r"--loss: unknown loss 'l1' \(known: cross_entropy, mse"):
        resolve_loss("l1")


def test_the_factory_gets_only_the_arguments_it_takes(plugin_file):
    got = []
    call_with_accepted(lambda in_shape: got.append(in_shape), in_shape=(3,), n_classes=4, hidden=8)
    call_with_accepted(lambda **kw: got.append(sorted(kw)), in_shape=(3,), n_classes=4)
    call_with_accepted(lambda: got.append("none"), in_shape=(3,))
    assert got == [(3,), ["in_shape", "n_classes"], "none"]
    workload = workload_from_config(make_config({"model": f"{plugin_file}:net"}))
    model = workload.build_model(seed=0, in_shape=(1, 5), n_classes=3, hidden=16)
    assert (model.in_features, model.out_features) == (5, 3)


def test_a_factory_returning_no_module_is_named(plugin_file):
    workload = workload_from_config(make_config({"model": "hpcps.plugins:is_plugin"}))
    with pytest.raises(UserError, match="--model hpcps.plugins:is_plugin: calling it failed"):
        workload.build_model(seed=0, in_shape=None, n_classes=None, hidden=8)
    workload = workload_from_config(make_config({"model": "builtins:dict"}))
    with pytest.raises(UserError, match="returned a dict, not a torch.nn.Module"):
        workload.build_model(seed=0, in_shape=None, n_classes=None, hidden=8)
