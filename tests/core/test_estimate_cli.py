"""What `zero-strategy estimate` prints: it fits 100 columns, says every size in GiB,
shows the paper's numbers and the offload rows as computed here from first principles,
and its --help gives examples that run."""
import re
import subprocess
import sys

import pytest

from zero_strategy.cli import main

GIB = 2**30
PSI = 7_500_000_000
INFLIGHT = 256 * 2**20  # ZeroConfig's nvme_inflight_bytes default
BUCKETS = 2 * 5_000_000  # two reduce buckets of ZeroConfig's default 5M elements


def _run(capsys, *argv) -> str:
    assert main(["estimate", *argv]) == 0
    return capsys.readouterr().out


def _section(out: str, title: str) -> list:
    """The table rows (lines indented by two spaces, header first) after the first line
    that starts with ``title``, split into cells on runs of 2+ spaces."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    while not lines[start].startswith("  "):  # the title may wrap over several lines
        start += 1
    rows = []
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def _close_to(printed: str, num_bytes: int) -> bool:
    """The printed GiB equals num_bytes / 2**30 rounded to the printed decimals."""
    decimals = len(printed.split(".")[1])
    return abs(float(printed.replace(",", "")) - num_bytes / GIB) <= 0.5 * 10**-decimals + 1e-12


WIDE_INPUTS = [
    ["--params", "1T"],
    ["--params", "1T", "--world-size", "1024"],
    ["--params", "10T", "--precision", "fp32", "--optimizer", "sgd"],
    ["--params", "1", "--world-size", "1,1024"],
    ["--params", "125M", "--world-size", "3", "--optimizer", "sgd_nomomentum", "--largest-unit", "25M",
     "--persistent-params", "1M", "--num-units", "97", "--prefetch-bucket-size", "0"],
    ["--params", "1T", "--memory-per-rank", "1GiB", "--disk-per-rank", "1GiB"],
    ["--params", "1T", "--world-size", "1,1024", "--memory-per-rank", "80GiB", "--disk-per-rank", "2e12"],
    ["--params", "7.5e9", "--memory-per-rank", "999999GiB"],
]


@pytest.mark.parametrize("argv", WIDE_INPUTS, ids=lambda a: " ".join(a))
def test_every_line_fits_100_columns(capsys, argv):
    out = _run(capsys, *argv)
    too_wide = [line for line in out.splitlines() if len(line) > 100]
    assert not too_wide, too_wide


@pytest.mark.parametrize("argv", WIDE_INPUTS, ids=lambda a: " ".join(a))
def test_the_only_unit_is_gib(capsys, argv):
    """Sizes are GiB; the paper's decimal GB appear only in the two-line note that
    converts them, and no raw byte counts are mixed in."""
    out = _run(capsys, *argv)
    lines = out.splitlines()
    note, rest = lines[:2], lines[2:]
    assert "2^30" in note[0] and "1.0737" in note[0] and "1.88 GB" in note[1] and "1.75 GiB" in note[1]
    units = re.findall(r"\d\s*(bytes|[KMGT]i?B|B)\b(?!/)", "\n".join(rest))  # not "K = 12 bytes/param"
    assert units and set(units) == {"GiB"}, sorted(set(units))
    assert not re.search(r"\b(GB|MB|MiB)\b", "\n".join(rest))
    assert "GiB per rank" in out


def test_paper_table_1_reads_off_in_gib(capsys):
    """The paper's Table 1 row for N = 64 (31.4, 16.6, 1.88 GB; 120 GB at stage 0)
    from its formulas, in GiB: 4Psi + 12Psi/N, 2Psi + 14Psi/N, 16Psi/N, 16Psi."""
    rows = _section(_run(capsys, "--params", "7.5B", "--world-size", "64"), "The paper's formula")
    assert rows[0] == ["stage", "params", "grads", "optimizer states", "total"]
    n = 64
    want = {  # stage -> (params, grads, optimizer states) in bytes
        "0 baseline": (2 * PSI, 2 * PSI, 12 * PSI),
        "1 P_os": (2 * PSI, 2 * PSI, 12 * PSI // n),
        "2 P_os+g": (2 * PSI, 2 * PSI // n, 12 * PSI // n),
        "3 P_os+g+p": (2 * PSI // n, 2 * PSI // n, 12 * PSI // n),
    }
    for row in rows[1:]:
        p, g, k = want[row[0]]
        assert all(_close_to(cell, b) for cell, b in zip(row[1:], (p, g, k, p + g + k))), row
    stage3 = next(row for row in rows if row[0] == "3 P_os+g+p")
    assert stage3[-1] == "1.75" and round(1.75 * GIB / 1e9, 2) == 1.88  # Table 1: 1.88 GB


def test_offload_rows_equal_the_formulas(capsys):
    """7.5B, N = 64, bf16 Adam. With cpu the device keeps the 16-bit parameters (and
    stage 1's whole gradient) and the host the shard's fp32 master, fp32 gradient and two
    moments (16 bytes/param/N); with nvme the master and moments (12/N, +2/N for the
    parameters) are files and the host holds the in-flight bound."""
    out = _run(capsys, "--params", "7.5B", "--world-size", "64", "--precision", "bf16")
    rows = _section(out, "With offload")
    assert rows[0] == ["stage", "offload", "device", "host", "disk"]
    s = PSI // 64
    want = [
        ("1", "cpu", 4 * PSI, 16 * s, 0),
        ("2", "cpu", 2 * PSI, 16 * s, 0),
        ("3", "cpu", 2 * s, 16 * s, 0),
        ("1", "nvme", 4 * PSI, INFLIGHT, 12 * s),
        ("2", "nvme", 2 * PSI + 2 * s, INFLIGHT, 12 * s),
        ("3", "nvme", 4 * s, INFLIGHT, 12 * s),
        ("3", "nvme+param", 2 * s, INFLIGHT, 14 * s),
    ]
    assert [tuple(r[:2]) for r in rows[1:]] == [w[:2] for w in want]
    for row, (_, _, device, host, disk) in zip(rows[1:], want):
        assert all(_close_to(cell, b) for cell, b in zip(row[2:], (device, host, disk))), row


def test_overheads_in_gib(capsys):
    """1T at N = 1024 with 25M-element buckets: stage 3 is the paper's 15.6 GB (16e12 / 1024
    bytes), and two fp16 buckets of 25M elements are 100e6 bytes."""
    out = _run(capsys, "--params", "1T", "--world-size", "1,1024", "--reduce-bucket-size", "25M")
    assert "N = 1," in out and "N = 1024," in out
    formula = _section(out.split("N = 1024,")[1], "The paper's formula")
    stage3 = next(row for row in formula if row[0] == "3 P_os+g+p")
    assert _close_to(stage3[-1], 15_625_000_000) and stage3[-1] == "14.55"
    buckets = re.findall(r"    stage 0: ([\d.]+) GiB", out.split("reduce_buckets:")[1])[0]
    assert _close_to(buckets, 2 * 25_000_000 * 2)


def test_memory_per_rank_says_what_fits_and_the_largest_model(capsys):
    budget, disk = 11 * GIB, 10 * GIB
    out = _run(capsys, "--params", "2B", "--world-size", "2", "--precision", "bf16",
               "--memory-per-rank", "11GiB", "--disk-per-rank", "10GiB")
    psi, s = 2 * 10**9, 10**9
    # Stage 0 holds 16 bytes/param and two 5M-element bf16 buckets: over the budget by
    held = _section(out, "This implementation")
    assert held[0][-1] == "fits in 11.00 GiB"
    over = held[1][-1]
    assert over.startswith("no: +") and _close_to(over[5:], 16 * psi + BUCKETS * 2 - budget), held[1]
    # Offload rows: stage 3 with cpu needs 2/N on the device + 16/N on the host = 18e9 bytes;
    # nvme+param fits in memory (2/N + in flight) but its 14/N of files do not fit 10 GiB.
    rows = {tuple(r[:2]): r for r in _section(out, "With offload")[1:]}
    assert _close_to(rows["3", "cpu"][5][5:], 18 * s - budget) and rows["3", "cpu"][6] == "-"
    assert rows["3", "nvme+param"][5] == "yes"
    assert _close_to(rows["3", "nvme+param"][6][5:], 14 * s - disk)
    # The largest models, inverted by hand: stage 0: (budget - buckets) // 16; stage 3 with cpu:
    # 18 * ceil(P/2) <= budget; nvme+param: limited by the disk, 14 * ceil(P/2) <= 10 GiB.
    largest = {r[0]: r[1] for r in _section(out, "Largest model")[1:]}
    assert largest["stage 0"] == f"{(budget - BUCKETS * 2) // 16:,}"
    assert largest["stage 3, offload cpu"] == f"{2 * (budget // 18):,} (limited by memory)"
    assert largest["stage 3, offload nvme+param"] == f"{2 * (disk // 14):,} (limited by disk)"


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", [[], ["estimate"], ["consolidate"]])
def test_help_names_the_lightning_consolidate_command(capsys, argv):
    text = _help(capsys, *argv)
    assert "python -m zero_strategy.integrations.lightning.consolidate CKPT_DIR OUT.ckpt" in text
    assert "zero-strategy consolidate CKPT_DIR OUT_DIR" in text


def test_help_examples_run(capsys):
    """--help shows the paper's Table 1 command and two more; each runs as printed."""
    text = _help(capsys, "estimate")
    assert "zero-strategy estimate --params 7.5e9 --world-size 1,4,16,64,256,1024" in text
    commands = re.findall(r"^  (zero-strategy estimate .*)$", text.replace(" \\\n      ", " "), re.M)
    assert len(commands) == 3, commands
    for command in commands:
        out = _run(capsys, *command.split()[2:])
        assert "The paper's formula" in out and "With offload" in out


def test_a_closed_pipe_ends_it_quietly():
    """`zero-strategy estimate ... | head -1`: the output (200 world sizes) is larger than a
    pipe holds, so the writer meets the closed pipe; it must exit without a traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "zero_strategy.cli", "estimate", "--params", "7.5e9",
                             "--world-size", ",".join(str(n) for n in range(1, 201))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 141
    assert first.startswith(b"Sizes are GiB") and stderr == b"", stderr.decode()[-2000:]
