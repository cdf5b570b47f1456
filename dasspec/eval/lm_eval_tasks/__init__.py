"""lm-evaluation-harness task configs shipped with dasspec (``*.yaml``, read by lm-eval through ``--include_path``
or ``dasspec.eval.lm_eval_model.task_manager()``) and the offline loaders they name (``utils.py``): GSM8K chain of
thought, MBPP multiple choice, MBPP perplexity, over ``$DASSPEC_DATA``.  Importing this package needs no lm-eval."""
