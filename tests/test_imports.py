"""The light parts of autotune stay light: each, in a fresh interpreter, loads none of the heavy libraries it has
no need of (torch above all), and a failure names the part and the chain of imports that pulled the library in.

The parts that must not load torch, and why a user cares: ``import autotune`` is instant (docs/estimate.md: importing
the package does nothing but define its names); the planner, the result types and the options are pure arithmetic and
plain data (DESIGN.md: the planner never imports torch, numpy or pandas); the store opens and answers without torch
(the service's server process never loads it); the frameworks autotune adapts to stay optional; and the commands
that only read or print (``--help``, ``store``, ``serve --help``, ``devices --presets``) start in a blink.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from .heavy import FRAMEWORKS, NUMPY, PANDAS, TORCH, watch

HEAVY = (TORCH, NUMPY, PANDAS)
#: What a store or service command has no need of: torch, the web service's libraries, pandas.
SERVICE = (TORCH, "fastapi", "uvicorn", PANDAS)
CLI = "import sys\nfrom autotune.cli import main\nsys.exit(main(sys.argv[1:]))\n"
PLANS = ("from autotune.planning import make_plan\n"
         "assert make_plan(1021, 256, world_size=2).to_dict()['target_batch'] == 1021\n")


@dataclass(frozen=True)
class Part:
    """A light part of autotune: the code that uses it, its arguments, and the libraries it must not load."""

    name: str
    code: str
    libraries: tuple[str, ...]
    argv: tuple[str, ...] = ()


PARTS = [
    Part("autotune", "import autotune\ndir(autotune), autotune.__all__, autotune.__version__\n", (TORCH,)),
    Part("autotune.planning", f"import autotune.planning\n{PLANS}", HEAVY),
    Part("autotune.planning.planner+exports", "import autotune.planning.planner, autotune.planning.exports\n"
         "from autotune.planning.exports import export\n"
         "export(autotune.planning.planner.make_plan(1024, 32, world_size=8), 'hf')\n", HEAVY),
    Part("autotune.results", f"import autotune.results\n{PLANS}", HEAVY),
    Part("autotune.serial", f"import autotune.serial\n{PLANS}", HEAVY),
    Part("autotune.options", f"import autotune.options\n{PLANS}", HEAVY),
    Part("autotune.store", "from autotune.store.store import Store\nfrom autotune.store.schema import Entry\n"
         "Store('sqlite://').close()\n", (TORCH,)),
    Part("autotune.report", "from autotune.report import load_result, write_report\n", (TORCH,)),
    # torch is theirs to load (autotune.Accumulator is a torch training loop); the frameworks are not, nor is the
    # store's database library where no store is used (a tenth of a second of every command's and rank's start)
    pytest.param(Part("autotune.integrations", "import autotune, autotune.api, autotune.integrations\n"
                      "import autotune.integrations.common\nautotune.Accumulator, autotune.Workload\n",
                      (*FRAMEWORKS, "sqlalchemy")), marks=pytest.mark.slow),
    Part("autotune --help", CLI, SERVICE, ("--help",)),
    Part("autotune store --help", CLI, SERVICE, ("store", "--help")),
    Part("autotune serve --help", CLI, SERVICE, ("serve", "--help")),
    Part("autotune store ls", f"import sys\nfrom autotune.store.store import Store\nStore(sys.argv[-1]).close()\n{CLI}",
         SERVICE, ("store", "ls", "--store", "{store}")),
    Part("autotune devices --presets", CLI, (TORCH,), ("devices", "--presets")),
]


def _name(part) -> str:
    return part.name


@pytest.mark.parametrize("part", PARTS, ids=_name)
def test_a_light_part_loads_no_heavy_library(part, tmp_path):
    argv = [a.format(store=f"sqlite:///{tmp_path / 'plans.db'}") for a in part.argv]
    watched = watch(part.code, *argv, libraries=part.libraries)
    assert watched.returncode == 0, watched.stderr[-2000:]
    assert watched.loaded == {}, f"{part.name} loaded {', '.join(watched.loaded)}: {watched.chains()}"


def test_the_watch_names_the_chain_that_pulled_a_library_in(tmp_path):
    """A planted heavy import, two modules deep and inside a function: the chain names each step."""
    (tmp_path / "outer.py").write_text("import inner\n")
    (tmp_path / "inner.py").write_text("def load():\n    import fractions\n")
    code = f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nimport outer\nouter.inner.load()\n"
    watched = watch(code, libraries=("fractions",))
    assert watched.returncode == 0, watched.stderr
    assert watched.loaded == {"fractions": ["<code>:4", "inner.load:2"]}
    assert watched.chains() == "<code>:4 -> inner.load:2 -> fractions"
