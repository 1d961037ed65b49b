"""The experiment registry: the built-in catalogues in a fixed order, whatever imported one first, and a name
registered twice refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fedtailor.fl import experiments


def test_the_listing_order_does_not_depend_on_what_was_imported_first():
    code = (
        "import fedtailor.methods.dpo.catalogue, fedtailor.methods.pfl.catalogue\n"
        "from fedtailor.fl.experiments import experiments\n"
        "print(' '.join(experiments()))"
    )
    names = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert names == list(experiments.EXPERIMENTS)
    assert names[0] == "compact-table1-mnist" and names[-1] == "pfeddpo-private-reduced"


def test_a_name_is_registered_once():
    exp = experiments.EXPERIMENTS["fedlag-mnist"]
    experiments.register_experiment(exp, module="fedtailor.methods.pfl.catalogue")  # the same one: accepted
    with pytest.raises(ValueError, match="registered already"):
        experiments.register_experiment(experiments.Experiment("fedlag-mnist", "another", ()))
