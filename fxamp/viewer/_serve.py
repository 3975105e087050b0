"""The child process of `fxamp.viewer.serve`: Model Explorer showing one saved view.

    python fxamp/viewer/_serve.py FILE PORT

Run by path, not with -m: it needs Model Explorer and the standard library, not fxamp or
torch, so it starts in about a second. It prints the page's URL on a line of its own, serves
on 127.0.0.1 only, and exits when its standard input closes: the parent closes it to stop it,
and the system closes it when the parent dies, so no server outlives its caller.
"""

import json
import os
import sys
import threading

URL_PREFIX = "FXAMP_VIEWER_URL "


def _exit_with_parent() -> None:
    sys.stdin.buffer.read()  # returns at end of file
    os._exit(0)


def main(path: str, port: int) -> None:
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    import model_explorer

    with open(path) as f:
        overlays = json.load(f)["fxamp"]["overlays"]
    config = model_explorer.config().add_model_from_path(path)
    for overlay in overlays:
        config.add_node_data(overlay["name"], json.dumps(overlay["nodeData"]))
    print(f"{URL_PREFIX}http://127.0.0.1:{port}/?data={config.to_url_param_value()}",
          flush=True)
    model_explorer.visualize_from_config(config, host="127.0.0.1", port=port,
                                         no_open_in_browser=True)


if __name__ == "__main__":
    sys.path.pop(0)  # this file's directory: its modules would shadow top-level ones
    main(sys.argv[1], int(sys.argv[2]))
