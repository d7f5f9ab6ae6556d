"""Callbacks that check an option's (or an argument's) own value while click parses the command line.

A malformed value, such as a run id with a slash, a name with capitals or a path that is not there, is a usage
error: click's one line "Invalid value for '--run-id': …" with exit code 2, before the command starts any work. The
rules are the library's, which raises InputError for the flows and tasks that take the same values; a well-formed
value that the warehouse does not hold (an unknown cohort, a run without rankings) is found by the command, and
exits 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from dxr.errors import InputError


@contextmanager
def usage_error(ctx: click.Context, param: click.Parameter) -> Iterator[None]:
    """A library check's InputError inside the block, as click's BadParameter for `param`."""
    try:
        yield
    except InputError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


def checked(ctx: click.Context, param: click.Parameter, value, check: Callable[[str], object]):
    """`value` after `check` has passed it (each value of a repeatable option), its InputError turned into click's
    BadParameter; an option left out (None) is not checked."""
    if value is None:
        return None
    with usage_error(ctx, param):
        for one in value if param.multiple else (value,):
            check(one)
    return value


def run_id(ctx: click.Context, param: click.Parameter, value):
    """A run id, to register or to look up: it becomes a partition value, part of file patterns and of lock names."""
    from warehouse.store import check_run_id

    return checked(ctx, param, value, check_run_id)


def dataset_name(ctx: click.Context, param: click.Parameter, value):
    from warehouse.datasets import check_name

    return checked(ctx, param, value, lambda name: check_name("dataset", name))


def cohort_name(ctx: click.Context, param: click.Parameter, value):
    from warehouse.datasets import check_name

    return checked(ctx, param, value, lambda name: check_name("cohort", name))


def cohort_key(ctx: click.Context, param: click.Parameter, value):
    """A cohort named by its name or its id."""
    from warehouse.datasets import check_cohort_key

    return checked(ctx, param, value, check_cohort_key)


def meds_directory(ctx: click.Context, param: click.Parameter, path: Path) -> Path:
    from warehouse.meds import check_meds_path

    return checked(ctx, param, path, check_meds_path)


def mimic_directory(source: str) -> Callable:
    """The callback of the PATH of `dxr ingest <source>`: the directory of that MIMIC release's tables."""

    def callback(ctx: click.Context, param: click.Parameter, path: Path) -> Path:
        from warehouse.importers.mimic import MIMIC3, MIMIC4, check_source_dir

        layout = {layout.source: layout for layout in (MIMIC3, MIMIC4)}[source]
        return checked(ctx, param, path, lambda src: check_source_dir(layout, src))

    return callback


def prior_systems(ctx: click.Context, param: click.Parameter, systems: tuple[str, ...]) -> tuple[str, ...]:
    """The learned priors named by a repeated --system: a system named twice is a usage error too."""
    from models.prior.config import check_prior_systems

    with usage_error(ctx, param):
        check_prior_systems(systems)
    return systems


def model_version(ctx: click.Context, param: click.Parameter, value):
    from models.prior.config import check_model_version

    return checked(ctx, param, value, check_model_version)


def search_query(ctx: click.Context, param: click.Parameter, value):
    from tools.index import check_query

    return checked(ctx, param, value, check_query)
