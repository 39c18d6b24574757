"""The ``rewardbox`` command line."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from .api.reward import SandboxedReward
from .api.session import RewardSandboxes
from .deploy import apparmor as profiles
from .errors import ConfigError, RewardboxError
from .images.base_image import OFFLINE_BASE
from .scoring.samples import samples_from_rows
from .spec import load_config
from .wire import Status

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Reward sandboxes for GRPO training.")
console = Console(stderr=True)
out_console = Console()

STATUS_STYLE = {"ok": "green", "error": "red", "timeout": "yellow", "crash": "magenta", "invalid": "red",
                "unavailable": "bright_black"}


QUIET_LOGGERS = ("httpx", "httpcore", "openai._base_client")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False, show_time=False)], force=True)
    for name in QUIET_LOGGERS:  # a line per HTTP request (an LLM judge's, the bench's) would bury the run's output
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)


def _sigterm_as_interrupt() -> None:
    """SIGTERM would end Python without running cleanup; make it unwind like Ctrl-C so sandboxes are removed."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def fail(message: str, code: int = 2) -> typer.Exit:
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file. Raises RewardboxError naming the file and line of bad JSON."""
    rows = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise RewardboxError(f"cannot read samples file {path}: {e.strerror}") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RewardboxError(f"{path}:{lineno}: not valid JSON: {e.msg}") from None
        if not isinstance(row, dict):
            raise RewardboxError(f"{path}:{lineno}: expected a JSON object with prompt and completion")
        rows.append(row)
    return rows


async def _score_all(rewards: list[SandboxedReward], samples: list, batch_size: int) -> dict:
    async def one(reward: SandboxedReward):
        reports = []
        for start in range(0, len(samples), batch_size):
            reports.append(await reward.client.score(samples[start : start + batch_size]))
        return reward.name, reports

    return dict(await asyncio.gather(*(one(r) for r in rewards)))


def _render(console_: Console, rewards: list[SandboxedReward], rows: list[dict], show: int) -> None:
    table = Table(title=f"scores ({min(show, len(rows))} of {len(rows)} samples)")
    table.add_column("#", justify="right")
    for r in rewards:
        table.add_column(r.name, justify="right")
    table.add_column("total", justify="right", style="bold")
    for row in rows[:show]:
        cells = [str(row["index"])]
        for r in rewards:
            value, status = row["scores"][r.name], row["status"][r.name]
            text = "None" if value is None else f"{value:.3g}"
            cells.append(text if status == "ok" else f"[{STATUS_STYLE[status]}]{text} ({status})[/]")
        cells.append("None" if row["total"] is None else f"{row['total']:.3g}")
        table.add_row(*cells)
    console_.print(table)

    summary = Table(title="per-function status")
    summary.add_column("reward")
    for s in Status:
        summary.add_column(s.value, justify="right", style=STATUS_STYLE[s])
    summary.add_column("fallback %", justify="right")
    for r in rewards:
        statuses = [row["status"][r.name] for row in rows]
        counts = [statuses.count(s) for s in Status]
        summary.add_row(r.name, *map(str, counts), f"{100 * (len(statuses) - counts[0]) / max(1, len(statuses)):.1f}")
    console_.print(summary)


@app.command()
def score(
    config: Path = typer.Argument(..., help="rewardbox YAML config"),
    samples: Path = typer.Option(..., "--samples", "-s", help="JSONL: prompt, completion (text or messages), columns"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="write one JSON object per sample here"),
    batch_size: int = typer.Option(64, min=1, help="samples per Score call"),
    backend: Optional[str] = typer.Option(None, help="override sandbox.backend: auto, or a registered backend "
                                                     "(`rewardbox backends` lists them)"),
    show: int = typer.Option(20, help="rows of the table to print"),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Score samples with every reward of CONFIG and print a table (and write --out)."""
    _setup_logging(verbose)
    _sigterm_as_interrupt()
    try:
        cfg = load_config(config)
        if backend:
            try:
                cfg.sandbox.backend = backend
            except ValueError as e:  # pydantic's ValidationError: an unregistered name
                raise RewardboxError(f"--backend: {e.errors()[0]['msg'] if hasattr(e, 'errors') else e}") from None
        rows_in = read_jsonl(samples)
        try:
            wire = samples_from_rows(rows_in)
        except ValueError as e:
            raise RewardboxError(f"{samples}: {e}") from None
        with RewardSandboxes(cfg) as sandboxes:
            keys = list(dict.fromkeys(k for row in rows_in for k in row
                                      if k not in ("prompt", "completion", "completion_ids")))
            sandboxes.check_columns(keys, {k: [row.get(k) for row in rows_in] for k in keys}, source=str(samples),
                                    rows=True)
            reports = asyncio.run(_score_all(sandboxes.rewards, wire, batch_size))
            rewards = sandboxes.rewards
    except RewardboxError as e:
        raise fail(str(e)) from None

    rows = []
    for i in range(len(wire)):
        row: dict[str, Any] = {"index": i, "scores": {}, "status": {}, "errors": {}, "total": None}
        for r in rewards:
            report = reports[r.name][i // batch_size]
            j = i % batch_size
            row["scores"][r.name] = report.values[j]
            row["status"][r.name] = str(report.statuses[j])
            row["errors"][r.name] = report.errors[j]
        scored = [(r.weight, row["scores"][r.name]) for r in rewards if row["scores"][r.name] is not None]
        row["total"] = sum(w * v for w, v in scored) if scored else None
        rows.append(row)
    for r in rewards:
        logs = "".join(rep.logs for rep in reports[r.name])
        if logs.strip() and verbose:
            console.rule(f"output of {r.name}")
            console.print(logs, markup=False, highlight=False)
    _render(out_console, rewards, rows, show)
    if out:
        out.write_text("".join(json.dumps(row) + "\n" for row in rows))
        console.print(f"wrote {len(rows)} rows to {out}")


def _progress_printer():
    def show(line: str) -> None:
        console.print(line, style="dim", highlight=False, markup=False)

    return show


@app.command()
def build(
    config: Path = typer.Argument(..., help="rewardbox YAML config"),
    force: bool = typer.Option(False, help="rebuild even when the image exists"),
    push: bool = typer.Option(False, "--push", help="also build the service image (`rewardbox serve`), and push "
                              "every image to --registry (for `rewardbox deploy kubernetes`)"),
    registry: Optional[str] = typer.Option(None, help="where --push sends the images: a host, optionally with "
                                           ":PORT and /PATH, e.g. registry.example.com:5000/team; the engine's "
                                           "`docker login` applies"),
) -> None:
    """Build the sandbox images a config needs (one per distinct package set); cached by content hash."""
    _setup_logging(False)
    from .backends.docker import docker_settings, engine_client
    from .images.image import ImageBuilder, registry_reference

    try:
        if push != (registry is not None):
            raise RewardboxError("--push and --registry go together: `rewardbox build CONFIG --push --registry "
                                 "HOST:PORT/PATH` (port and path optional)")
        if registry is not None:
            registry_reference(registry, "check")  # a malformed registry fails before anything is built
        cfg = load_config(config)
        settings = docker_settings(cfg.sandbox)
        builder = ImageBuilder(engine_client(), settings.cache_dir, on_output=_progress_printer())
        tags = []
        for (packages, system), (tag, owners) in builder.ensure_images(cfg.rewards, settings, force=force).items():
            out_console.print(f"{tag}  rewards: {', '.join(owners)}  packages: {', '.join(packages) or '-'}"
                              + (f"  system packages: {', '.join(system)}" if system else ""))
            tags.append(tag)
        if push:
            assert registry is not None  # checked above: --push comes with --registry
            service = builder.ensure_service(settings, force=force)
            out_console.print(f"{service}  the service image (`rewardbox serve`)")
            for tag in [*tags, service]:
                out_console.print(f"pushed {builder.push(tag, registry)}", highlight=False, soft_wrap=True)
    except RewardboxError as e:
        raise fail(str(e)) from None


@app.command("base-image")
def base_image(
    tag: str = typer.Option(OFFLINE_BASE, help="tag of the image to create"),
    suite: str = typer.Option("bookworm", help="Debian suite"),
    mirror: str = typer.Option("http://deb.debian.org/debian", help="Debian mirror"),
    force: bool = typer.Option(False, help="rebuild even when the tag exists"),
) -> None:
    """Build a minimal Debian image with python3 from Debian packages alone (for hosts without a registry)."""
    _setup_logging(False)
    import docker.errors

    from .backends.docker import engine_client
    from .images.base_image import build_offline_base

    try:
        client = engine_client()
        try:
            client.images.get(tag)
            exists = True
        except docker.errors.ImageNotFound:
            exists = False
        if force or not exists:
            build_offline_base(client, tag=tag, suite=suite, mirror=mirror, on_output=_progress_printer())
        out_console.print(tag)
    except RewardboxError as e:
        raise fail(str(e)) from None


@app.command()
def apparmor(
    install: bool = typer.Option(False, "--install", help="write it to /etc/apparmor.d and load it (root)"),
    name: str = typer.Option(profiles.NAME, help="the profile's name"),
    userns: bool = typer.Option(False, "--userns", help="AppArmor 4.0's ABI and user namespaces allowed, for hosts "
                                "that force user-namespace mediation on every profile "
                                "(kernel.apparmor_restrict_unprivileged_userns_force=1)"),
) -> None:
    """Print (or --install) an AppArmor profile for sandbox containers: Docker's default one with the three mounts of
    the private /tmp allowed. On hosts that confine containers with AppArmor, Docker's default profile refuses them and
    /tmp stays read-only; after --install, set sandbox.docker.apparmor_profile to NAME."""
    try:
        text = profiles.profile(name, userns=userns)
        if not install:
            typer.echo(text, nl=False)
            return
        path = profiles.install(text, name)
    except RewardboxError as e:
        raise fail(str(e)) from None
    out_console.print(f"loaded {path}; set `sandbox.docker.apparmor_profile: {name}` in the config")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(
    ctx: typer.Context,
    config: Path = typer.Argument(..., help="training YAML: sandbox, rewards, model, dataset, grpo, lora"),
    in_process: bool = typer.Option(False, "--in-process", help="call the reward files in this process as plain "
                                    "TRL reward functions: NO sandbox and NO isolation (debugging, comparisons)"),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Train with GRPO on sandboxed rewards. Override any field: --grpo.max_steps 5 --lora.r 8."""
    _setup_logging(verbose)
    _sigterm_as_interrupt()
    from .trainer import load_train_config
    from .trainer import train as run_training

    try:
        cfg = load_train_config(config, ctx.args)
        result = run_training(cfg, in_process=in_process)
    except RewardboxError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        raise fail("interrupted; all sandboxes were removed", code=130) from None
    if not result.is_main_process:
        return
    rewards = [h["reward"] for h in result.log_history if "reward" in h]
    if rewards:
        k = min(10, len(rewards))
        out_console.print(f"{len(rewards)} steps; mean total reward of the first {k} steps: "
                          f"{sum(rewards[:k]) / k:.3f}, of the last {k}: {sum(rewards[-k:]) / k:.3f}")
    out_console.print(f"saved to {result.output_dir} (adapter, tokenizer, record.sqlite, reward_logs.jsonl, "
                      "rewards.png)", soft_wrap=True)
    if (result.output_dir / "record.sqlite").exists():
        out_console.print(f"every completion, score and print: rewardbox report {result.output_dir}", soft_wrap=True)


@app.command()
def bench(
    base_image: str = typer.Option("auto", help="base image of the sandbox image (sandbox.docker.base_image)"),
    iterations: int = typer.Option(200, min=10, help="64-sample batches for the overhead figure"),
    parts: str = typer.Option("abcdefghrytvo", help="which parts to run (see `rewardbox.bench.run`): a overhead, b "
                              "throughput, c cold start, d builds, e LLM judge, f remote path, g code execution, h "
                              "isolation: sample at 1,024 and 4,096 completions, r run record and report, y ray "
                              "backend, t tool calls, v environments, o OpenRLHF's HTTP route"),
) -> None:
    """Measure sandbox overhead, throughput, cold start and build times; print them beside our targets."""
    _setup_logging(False)
    from .bench.run import run_bench

    try:
        figures = run_bench(base_image, iterations, progress=lambda m: console.print(m, style="dim"), parts=parts)
    except RewardboxError as e:
        raise fail(str(e)) from None
    table = Table(title="rewardbox bench (docker backend, this machine)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_column("met")
    for f in figures:
        met = "" if f.met is None else ("[green]yes[/]" if f.met else "[red]no[/]")
        table.add_row(f.name, f.value, f.target, met)
    out_console.print(table)


@app.command()
def clean(
    images: bool = typer.Option(False, "--images", help="also remove sandbox images no container uses"),
) -> None:
    """Remove containers left by runs whose process is gone (and, with --images, unused sandbox images)."""
    _setup_logging(False)
    from .backends.docker import engine_client, prune_images, remove_leftovers

    try:
        client = engine_client()
    except RewardboxError as e:
        raise fail(str(e)) from None
    containers = remove_leftovers(client)
    out_console.print(f"removed {len(containers)} leftover container(s)")
    if images:
        tags = prune_images(client)
        out_console.print(f"removed {len(tags)} unused sandbox image(s)")
        for tag in tags:
            out_console.print(f"  {tag}", highlight=False, soft_wrap=True)


@app.command()
def backends() -> None:
    """List the registered sandbox backends and their settings (sandbox.<name>: in the config)."""
    from .backends import backend_types

    try:
        types = backend_types()
    except RewardboxError as e:
        raise fail(str(e)) from None
    table = Table(title="sandbox backends (sandbox.backend: auto picks docker, never local)")
    table.add_column("backend")
    table.add_column("isolated")
    table.add_column("settings (sandbox.<backend>.<key>)")
    table.add_column("what it is")
    for t in types:
        fields = ", ".join(f"{k}={v.default!r}" if v.default_factory is None else k
                           for k, v in t.settings_type.model_fields.items())
        table.add_row(t.name, "yes" if t.isolated else "[red]NO[/]", fields or "-", t.summary)
    out_console.print(table)


@app.command()
def serve(
    config: Path = typer.Argument(..., help="rewardbox YAML config: the rewards to serve, where they run"),
    listen: str = typer.Option("127.0.0.1:50051", help="HOST:PORT; other than loopback needs TLS and a token"),
    tls_cert: Optional[Path] = typer.Option(None, help="the service's certificate chain (PEM)"),
    tls_key: Optional[Path] = typer.Option(None, help="its private key (PEM)"),
    tls_client_ca: Optional[Path] = typer.Option(None, help="require client certificates signed by this CA (PEM): "
                                                 "peers without one are refused in the TLS handshake, before HTTP/2"),
    token_env: str = typer.Option("REWARDBOX_TOKEN", help="environment variable holding the token clients must "
                                  "send; checked whenever it is set"),
    backend: Optional[str] = typer.Option(None, help="override sandbox.backend of CONFIG (where the sandboxes run)"),
    max_message_mb: int = typer.Option(64, min=1, max=2047, help="the largest request (MiB): what your largest batch "
                                       "needs; larger ones are refused with RESOURCE_EXHAUSTED"),
    max_concurrent_rpcs: int = typer.Option(256, min=1, help="RPCs running at once, all clients together; more are "
                                            "refused at once"),
    max_streams_per_connection: int = typer.Option(16, min=1, help="concurrent HTTP/2 streams per connection"),
    max_connections: int = typer.Option(512, min=1, help="connections at once, authenticated or not"),
    stream_window_kb: int = typer.Option(64, min=16, help="HTTP/2 window per stream (KiB): what a request may send "
                                         "before it is authenticated; raise it for large batches over long links"),
    episode_idle_s: float = typer.Option(3600.0, min=1.0, help="an environment's episode with no call for this long "
                                         "is ended (its trainer died without ending it)"),
    openrlhf: Optional[str] = typer.Option(None, help="HOST:PORT: serve OpenRLHF's remote reward protocol over HTTP "
                                           "(POST /get_reward, for --remote_rm_url) instead of gRPC; other than "
                                           "loopback needs TLS and a token, as --listen"),
    openrlhf_max_body_mb: int = typer.Option(16, min=1, help="--openrlhf: the largest request body (MiB); larger "
                                             "ones are refused (413) before they are read"),
    openrlhf_max_in_flight: int = typer.Option(4096, min=1, help="--openrlhf: requests answered at once; more are "
                                               "refused at once (503: OpenRLHF's client tries again)"),
    openrlhf_max_in_flight_mb: int = typer.Option(256, min=1, help="--openrlhf: what the requests answered at once "
                                                  "may hold together (MiB, counted as their bodies arrive); more: 503"),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Serve CONFIG's rewards to many trainers and ranks on one authenticated endpoint (`backend: remote`), or with
    --openrlhf, to OpenRLHF over its HTTP reward protocol."""
    _setup_logging(verbose)
    from .serve.openrlhf import HttpLimits, serve_openrlhf
    from .serve.service import ServiceLimits, ServiceSecurity, limit_malloc_arenas, raise_open_files
    from .serve.service import serve as run_service

    limit_malloc_arenas()  # before gRPC starts its threads
    raise_open_files()  # idle connections must not exhaust descriptors before max_connections refuses them
    option, address = ("--openrlhf", openrlhf) if openrlhf is not None else ("--listen", listen)

    def ready(sandboxes, port: int) -> None:
        host = address.rsplit(":", 1)[0]
        names = ", ".join(r.name for r in sandboxes.rewards)
        if openrlhf is None:
            where, stopping = f"on {host}:{port}", "drains and stops"
        else:
            where = f"to OpenRLHF on {'https' if security.certificate else 'http'}://{host}:{port}/get_reward"
            stopping = "stops"
        out_console.print(f"serving {names} {where} ({security.describe()}); Ctrl-C or SIGTERM {stopping}",
                          highlight=False, soft_wrap=True)

    try:
        security = ServiceSecurity.from_options(address, tls_cert, tls_key, token_env, tls_client_ca, option=option)
        cfg = load_config(config)
        if backend:
            cfg.sandbox.backend = backend
        if openrlhf is not None:
            http_limits = HttpLimits(openrlhf_max_body_mb << 20, openrlhf_max_in_flight,
                                     openrlhf_max_in_flight_mb << 20)
            asyncio.run(serve_openrlhf(cfg, openrlhf, security, http_limits, on_ready=ready))
        else:
            limits = ServiceLimits(max_message_mb * 1024 * 1024, max_concurrent_rpcs, max_streams_per_connection,
                                   max_connections, stream_window_kb * 1024, episode_idle_s=episode_idle_s)
            asyncio.run(run_service(cfg, listen, security, on_ready=ready, limits=limits))
    except RewardboxError as e:
        raise fail(str(e)) from None
    except OSError as e:
        raise fail(f"{option} {address}: {e}") from None
    except ValueError as e:  # pydantic's ValidationError for --backend
        raise fail(f"--backend: {e}") from None
    out_console.print("stopped; all sandboxes were removed")


@app.command()
def report(
    output_dir: Path = typer.Argument(..., help="a training run's output_dir (or its record.sqlite)"),
    listen: str = typer.Option("127.0.0.1:8050", help="HOST:PORT; other than loopback needs a token"),
    token_env: str = typer.Option("REWARDBOX_REPORT_TOKEN", help="environment variable holding the token every "
                                  "request must carry (required to listen beyond loopback)"),
) -> None:
    """Serve the run report: reward graphs, completions side by side across steps, reward logs per sample,
    search, reward-hacking signals. Live while training writes the record; read-only."""
    from .report.app import RecordError, make_server

    token = os.environ.get(token_env) or None
    try:
        server = make_server(output_dir, listen, token)
    except (RecordError, ConfigError) as e:
        raise fail(str(e)) from None
    except OSError as e:
        raise fail(f"--listen {listen}: cannot listen there ({e}); pick another port") from None
    host, port = server.server_address[:2]
    assert isinstance(host, str)  # an IP server's address is (host, port, ...); bytes only name AF_UNIX sockets
    address = f"http://{'[' + host + ']' if ':' in host else host}:{port}/"
    out_console.print(f"rewardbox report on {address}{'?token=<the token>' if token else ''} (Ctrl-C stops it)")
    _sigterm_as_interrupt()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


@app.command("sandbox-server")
def sandbox_server(
    listen: str = typer.Option("unix:///tmp/rewardbox.sock", help="unix:///path.sock or host:port"),
) -> None:
    """Run one bare sandbox server (what runs inside each container) as this process, for debugging with grpcurl.
    No isolation, no authentication: use `rewardbox serve` to share sandboxes."""
    # exec, not import: the host side never loads the sandbox's modules.
    os.execv(sys.executable, [sys.executable, "-m", "rewardbox.sandbox", "--listen", listen])


deploy_app = typer.Typer(no_args_is_help=True, help="Manifests that run a config's rewards as shared services.")
app.add_typer(deploy_app, name="deploy")


@deploy_app.command("kubernetes")
def deploy_kubernetes(
    config: Path = typer.Argument(..., help="rewardbox YAML config: the rewards to deploy"),
    registry: str = typer.Option(..., help="the registry `rewardbox build --push --registry` pushed the images to"),
    namespace: Optional[str] = typer.Option(None, help="set on every object (default: kubectl's namespace)"),
    runtime_class: Optional[str] = typer.Option(None, "--runtime-class", help="the pods' RuntimeClass; default: "
                                                "gvisor when sandbox.docker.runtime is runsc, else that runtime's "
                                                "name; none without a runtime"),
    trainer_label: str = typer.Option("rewardbox.dev/trainer=true", help="KEY=VALUE: the label of the pods that "
                                      "may connect (the NetworkPolicy's ingress)"),
    client_certificates: bool = typer.Option(False, "--client-certificates", help="the gateways require client "
                                             "certificates signed by the CA in the secret rewardbox-client-ca "
                                             "(mutual TLS: a peer without one never reaches HTTP/2)"),
) -> None:
    """Print Kubernetes manifests serving CONFIG's rewards (`| kubectl apply -f -`): per reward a Deployment (sandbox
    and gateway containers), a headless Service, a NetworkPolicy and a ConfigMap. Reads the image tags from the
    Docker engine; touches no cluster."""
    _setup_logging(False)
    from .deploy.kubernetes import render

    try:
        text = render(load_config(config), registry, namespace=namespace, runtime_class=runtime_class,
                      trainer_label=trainer_label, client_certificates=client_certificates)
    except RewardboxError as e:
        raise fail(str(e)) from None
    typer.echo(text, nl=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
