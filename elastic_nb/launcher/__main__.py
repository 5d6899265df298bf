"""`python -m elastic_nb.launcher`: one launcher, warm until it is handed a job (agent.py)."""

from elastic_nb.launcher.agent import main

if __name__ == "__main__":
    main()
