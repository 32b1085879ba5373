"""Gym's entry point for gym-bridge's model server: Gym runs ``python app.py`` in this folder."""

from gym_bridge.gym_model.app import main

if __name__ == "__main__":
    main()
