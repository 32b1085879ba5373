"""A Gym agent whose ``/run`` result carries no token ids, as an external harness's does: Gym's ``simple_agent``
with the token fields of its response removed before it returns (the verifier has already scored it)."""

from fastapi import Request
from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentRunRequest, SimpleAgentVerifyResponse

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class TokenlessAgent(SimpleAgent):
    async def run(self, request: Request, body: SimpleAgentRunRequest) -> SimpleAgentVerifyResponse:
        result = await super().run(request, body)
        for item in result.response.output:
            for field in TOKEN_FIELDS:
                if getattr(item, field, None) is not None:
                    setattr(item, field, None)
        return result


if __name__ == "__main__":
    TokenlessAgent.run_webserver()
