"""What the regime's result scripts share: the Picchio runs of a results directory regime.sh
wrote, and a phase's figures per token. Standard library only."""
import json
import sys


def picchio_runs(results, prog):
    """(run name, its `picchio bench --json` output) for every `picchio-*.json` in `results`,
    in name order. Exits with a message naming `prog` and the file when there is none or one
    cannot be read."""
    runs = sorted(results.glob("picchio-*.json"))
    if not runs:
        sys.exit(f"{prog}: no picchio-*.json in {results}")
    for f in runs:
        try:
            j = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            sys.exit(f"{prog}: {f}: {e}")
        yield f.stem[len("picchio-"):], j


def per_token_ms(phase, key, prog):
    """`phase[key]` (seconds over the phase) in ms per token of the phase."""
    n = phase.get("tokens", 0)
    if n <= 0:
        sys.exit(f"{prog}: a phase with no tokens")
    return 1e3 * phase[key] / n
