"""The failing tests (and graph/eager subtests) of a pytest log written by run.sh, each
with the first line of its error: ``python failures.py LOG``."""
import re
import sys

text = open(sys.argv[1], errors="replace").read().split("short test summary info")[0]
parts = re.split(r"\n_+ (\S+\.test_\S+(?: \[\w+\])?) _+\n", text)
for i in range(1, len(parts) - 1, 2):
    error = re.search(r"^E\s+(.*)$", parts[i + 1], re.M)
    print(parts[i].split(".", 1)[-1].ljust(66), error.group(1)[:140] if error else "?")
