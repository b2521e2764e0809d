"""Serve a random workload with HiSparse (and the full-KV baseline), or decode a checkpoint.

    python run_decode.py                    # tiny random-weight model, HiSparse vs baseline, CPU ok
    python run_decode.py --checkpoint=DIR --prompts=prompts.npz --output=out.npz --max_new_tokens=32
    python run_decode.py --help             # every flag (SGLang's names, with underscores)

The flags and what they run live in serving/run_decode.py (also installed as the
`hisparse-decode` command); this file is the script the design card names.
"""

from serving.run_decode import run

if __name__ == "__main__":
    run()
