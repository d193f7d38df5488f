"""A chat template that prints the tools, each message's calls and the tool results: the tool
calling tests' prompts show what reached the template."""

TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | map(attribute='function') | map(attribute='name') "
    "| join(',') }}\n{% endif %}{% for m in messages %}{{ m.role }}:{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}({{ c.function.arguments.city }})"
    "{% endfor %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def template_file(tmp_path_factory) -> str:
    """TEMPLATE in a file of its own, for --chat-template."""
    path = tmp_path_factory.mktemp("template") / "tools.jinja"
    path.write_text(TEMPLATE)
    return str(path)
