"""The local lm-eval multiple-choice task the harness tests and the `eslm lm-eval` test share: a JSON-lines
file of {question, choices, label} rows (``{data}``), scored by acc and acc_norm."""

MC_YAML = """task: t_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
fewshot_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
