"""elastictrain's command line: one typer app, one module per command group.

train.py: train, resume. runs.py: status, runs, verify, sync, reshard, build-ops. eval.py: eval.
export.py: export. prepare.py: prepare-data. preview.py: preview-data. plot.py: plot.
"""

from __future__ import annotations

import sys

import typer

from elastictrain.cli.eval import evaluate_command
from elastictrain.cli.export import export_command
from elastictrain.cli.output import err
from elastictrain.cli.plot import plot_command
from elastictrain.cli.prepare import prepare_data_command
from elastictrain.cli.preview import preview_data_command
from elastictrain.cli.runs import build_ops_command, reshard, runs, status, sync, verify
from elastictrain.cli.train import resume, train
from elastictrain.redact import install_exception_redaction

# typer's own traceback printer would show locals (a config holding a token): ours masks instead.
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Elastic training on Ray with DeepSpeed ZeRO-3.",
    pretty_exceptions_enable=False,
)
install_exception_redaction()
for command in (train, resume, status, runs, verify, sync, reshard):
    app.command()(command)
app.command("build-ops")(build_ops_command)
app.command("eval")(evaluate_command)
app.command("prepare-data")(prepare_data_command)
app.command("preview-data")(preview_data_command)
app.command("plot")(plot_command)
app.command("export")(export_command)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
