"""File contracts: the records of prompts.jsonl / rollouts.jsonl, the training batch file, parquet prompts, prompt
selection and the images a batch carries.
"""
