"""The backend's Python face: ft's reconfigurable process groups over ``ft._C``
(:mod:`ft.backend.process_group`), and the registration of the torch backend ``"ft"``
(:mod:`ft.backend.registration`). Imports nothing above it; importing this package loads
neither torch nor the extension."""
