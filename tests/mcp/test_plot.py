"""The loss-curve picture: train and eval loss named in the legend, integer steps, resumes marked."""

from __future__ import annotations

from matplotlib import pyplot as plt

from mcp_server.plot import loss_curve_figure, loss_curve_png

RECORDS = [
    {"step": 1, "loss": 5.0, "lr": 1e-3},
    {"step": 2, "loss": 4.5, "lr": 1e-3, "eval_loss": 4.8},
    {"step": 3, "loss": 4.2, "lr": 9e-4},
]


def test_the_legend_names_train_and_eval_loss_and_steps_are_integers():
    figure = loss_curve_figure(RECORDS, "run x")
    try:
        figure.canvas.draw()
        legend = next(a.get_legend() for a in figure.axes if a.get_legend() is not None)
        assert [t.get_text() for t in legend.get_texts()] == ["train loss", "eval loss", "learning rate"]
        loss_axis = figure.axes[0]
        ticks = [t for t in loss_axis.get_xticks() if 1 <= t <= 3]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    finally:
        plt.close(figure)


def test_each_resume_is_a_vertical_line_named_by_the_run_that_took_over():
    figure = loss_curve_figure(RECORDS, "run child", resumes=[(2, "20261130-000000-lm-beef")])
    try:
        axis = figure.axes[0]
        vertical = [line for line in axis.get_lines() if list(line.get_xdata()) == [2, 2]]
        assert len(vertical) == 1
        assert [t.get_text() for t in axis.texts] == ["resumed: 20261130-000000-lm-beef"]
    finally:
        plt.close(figure)


def test_an_empty_history_still_gives_a_picture():
    assert loss_curve_png([], "run y").startswith(b"\x89PNG\r\n\x1a\n")


def test_finite_extreme_values_are_left_out_and_said_so_through_the_resource_and_the_cli(tmp_path):
    """±1e308 made run://<id>/loss.png fail (-32603) and `trainwright plot` exit 70."""
    import json

    import anyio
    from mcp import Client

    from mcp_server import cli
    from mcp_server.server import build_server
    from tests.sandbox.helpers import fake_run, make_workspace

    root = make_workspace(tmp_path / "ws")
    run_dir = fake_run(root, "extreme", steps=0, checkpoints=())
    rows = [{"step": 1, "loss": 3.0, "lr": 1e308}, {"step": 2, "loss": 1e308, "eval_loss": -1e308},
            {"step": 3, "loss": -1e308}, {"step": 4, "loss": 2.0}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figure = loss_curve_figure(rows, "run extreme")
    try:
        figure.canvas.draw()
        axis = figure.axes[0]
        assert [list(line.get_ydata()) for line in axis.get_lines()] == [[3.0, 2.0]]
        assert "4 value(s) beyond ±1e+15 not drawn" in [t.get_text() for t in axis.texts]
    finally:
        plt.close(figure)

    async def read() -> bytes:
        async with Client(build_server(root), mode="legacy") as client:
            result = await client.read_resource("run://extreme/loss.png")
            import base64

            return base64.b64decode(result.contents[0].blob)

    assert anyio.run(read).startswith(b"\x89PNG\r\n\x1a\n")
    out = tmp_path / "loss.png"
    assert cli.main(["plot", "extreme", "-o", str(out), "--workspace", str(root)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
