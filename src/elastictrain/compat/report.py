"""Which DeepSpeed and transformers this process imports and which of elastictrain's patches apply:
`python -m elastictrain.compat.report` (the first thing `make test-compat` prints)."""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings


def main() -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from elastictrain.compat.registry import CompatError, all_patches, check_all, installed_version

    spec = importlib.util.find_spec("deepspeed")
    where = spec.origin if spec else "nowhere"
    import deepspeed  # noqa: F401  # its own __version__ then says which release this process runs

    version = installed_version("deepspeed")
    print(f"deepspeed {version} from {where}")
    import transformers

    tf_version = installed_version("transformers")
    print(f"transformers {tf_version} from {transformers.__file__}")
    for package, found in (("deepspeed", version), ("transformers", tf_version)):
        expected = os.environ.get(f"ELASTICTRAIN_EXPECT_{package.upper()}")
        if expected and found != expected:
            print(f"expected {package} {expected}: PYTHONPATH does not put it first")
            return 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            applies = check_all()
        except CompatError as e:
            print(f"refused: {e}")
            return 1
    for name, patch in sorted(all_patches().items()):
        print(f"  {'applies' if applies[name] else 'SKIPPED'}  {name} ({patch.kind}, {patch.package})")
    for warning in caught:
        print(f"  warning: {warning.message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
