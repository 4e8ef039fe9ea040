"""Execute a notebook in this Python (the fresh venv of .ci/colab-check) and report each cell.

Usage: python colab_run.py IN.ipynb OUT.ipynb. Exit 0 when every code cell ran without an error.
"""

import os
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

source, target = sys.argv[1], sys.argv[2]
nb = nbformat.read(source, as_version=4)
client = NotebookClient(nb, timeout=600, kernel_name="python3",
                        resources={"metadata": {"path": os.getcwd()}})
start = time.time()
status = 0
try:
    client.execute()
except CellExecutionError as error:
    print(f"FAILED: {str(error).splitlines()[-1] if str(error) else error!r}")
    status = 1
finally:
    nbformat.write(nb, target)
code = [c for c in nb.cells if c.cell_type == "code"]
ran = [c for c in code if c.get("execution_count")]
for c in code[:1]:
    for out in c.get("outputs", []):
        print("first cell:", (out.get("text") or "").strip()[:300])
print(f"{len(ran)} of {len(code)} code cells ran in {time.time() - start:.0f} s; "
      f"executed notebook: {target}")
sys.exit(status)
