"""The `add` tool of the verifiers_arith taskset: verifiers runs this module as its own MCP server process."""

import verifiers.v1 as vf


class AddToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool is called `add`

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """The sum of two integers."""
        return a + b


if __name__ == "__main__":
    AddToolset.run()
