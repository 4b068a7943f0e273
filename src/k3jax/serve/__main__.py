from k3jax.serve import main

raise SystemExit(main())
