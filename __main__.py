"""colocate's Pulumi entry point: `pulumi up -s <stack>` runs this."""

from infra.program import main

main()
