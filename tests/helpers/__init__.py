"""What several test files share, imported as `helpers.<module>` (pytest puts tests/ on sys.path). Test modules import
these, never each other:

- `models`: the devices to test on, tiny Hugging Face checkpoints, the registry's vanilla decoder;
- `kernels`: where the kernel tests run and their tolerances against the float64 references;
- `speculative`: the tiny pair, prompts, Dustin config and `run` of the round's end-to-end tests;
- `pipeline`: the pipeline tests' models and configs and the launching of ranks as processes;
- `engines`: the tiny pair's engine limits and `build`;
- `serving`: the served configuration and the runtime's direct answer to compare with;
- `stats`: the chi-square test of sampled distributions.
"""
