"""Run the explorer against a copy of the package with one fix taken back out.

    python -m tests.explorer.reverted --list
    TEST_DATABASE=postgresql python -m tests.explorer.reverted pg-lock-timeout [pytest args]

Each reversion puts back, in a temporary git worktree of ``HEAD``, the code
one fix replaced (the region is matched exactly, so a reversion that no
longer applies fails loudly instead of testing nothing), then runs
``tests/explorer`` there with that copy of the package first on the path.
The worktree is removed afterwards. The explorer is expected to fail; see
"Exploring the claim protocol" in docs/reliability.rst for what each finds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Reversion:
    what: str
    path: str
    fixed: str
    old: str


REVERSIONS = {
    "pg-lock-timeout": Reversion(
        "PostgreSQL: a claim that finds the key taken leaves the bounded lock_timeout in force",
        "django_idempotency/backends/postgresql.py",
        'f"SELECT inserted.{pk}, {RESTORED_WAIT} FROM wait LEFT JOIN inserted ON true"',
        'f"SELECT inserted.{pk}, NULL FROM wait LEFT JOIN inserted ON true"',
    ),
    "sqlite-busy-timeout": Reversion(
        "SQLite: the claim's busy timeout stays on the connection for the view",
        "django_idempotency/backends/sqlite.py",
        "            connection._idempotency_restore_busy_timeout = own"
        "  # type: ignore[attr-defined]\n",
        "",
    ),
    "lease-dead-connection": Reversion(
        "lease mode ends its lease only on the connection that died",
        "django_idempotency/lease_connection.py",
        "            if self.shares_request_transaction():\n                raise\n"
        "        with self.statements(fresh=True):\n            return step()\n",
        "            raise\n",
    ),
    "lease-in-transaction": Reversion(
        "lease mode refuses to run inside the request's transaction",
        "django_idempotency/lease_connection.py",
        "        return cls(using, needs_own_connection(using))\n",
        "        from django.core.exceptions import ImproperlyConfigured\n\n"
        "        if needs_own_connection(using):\n"
        "            raise ImproperlyConfigured('Lease mode inside a transaction')\n"
        "        return cls(using, False)\n",
    ),
    "release-after-effect": Reversion(
        "lease mode gives the key back when storing a successful response fails",
        "django_idempotency/engine.py",
        "        outcome = self._complete_or_without_body(complete, stored, lease, owned)\n",
        "        try:\n"
        "            outcome = complete(stored), stored\n"
        "        except Exception:\n"
        "            self._release(owned)\n"
        "            raise\n",
    ),
    "progress-fence": Reversion(
        "a checkpoint or heartbeat is written without the owner token's fence",
        "django_idempotency/store.py",
        "    fence = OWN_TRANSACTION if owner_token is None else OWNER\n",
        "    fence = OWN_TRANSACTION\n",
    ),
}


def revert(tree: Path, name: str) -> None:
    reversion = REVERSIONS[name]
    path = tree / reversion.path
    text = path.read_text()
    if text.count(reversion.fixed) != 1:
        sys.exit(f"{name}: the fixed code is not found exactly once in {reversion.path}")
    path.write_text(text.replace(reversion.fixed, reversion.old))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", choices=sorted(REVERSIONS))
    parser.add_argument("--list", action="store_true")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.list or not args.name:
        for name, reversion in REVERSIONS.items():
            print(f"{name:24} {reversion.what}")
        return 0
    tree = Path(tempfile.mkdtemp(prefix="explorer-reverted-"))
    subprocess.run(
        ["git", "worktree", "add", "--quiet", "--detach", str(tree), "HEAD"], cwd=ROOT, check=True
    )
    try:
        # The explorer as it is now, committed or not.
        shutil.rmtree(tree / "tests" / "explorer", ignore_errors=True)
        shutil.copytree(ROOT / "tests" / "explorer", tree / "tests" / "explorer")
        revert(tree, args.name)
        env = {**os.environ, "PYTHONPATH": str(tree)}
        command = [sys.executable, "-m", "pytest", "tests/explorer", "-p", "no:cacheprovider"]
        completed = subprocess.run([*command, *args.pytest_args], cwd=tree, env=env)
        return completed.returncode
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
        shutil.rmtree(tree, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
